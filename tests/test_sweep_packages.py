"""benchmarks/sweep_packages.py: the layer audit's population in the zoo extra's packages, every *Attention class.

With the zoo extra: the enumeration (every class of the package whose name ends in "Attention", a command-line
`__main__` not run) and two rows of the sweep on vit-pytorch, in a forked child as the sweep runs them: a layer that
passes zero-config, and one that needs the declaration its report names first and passes with it.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT / "benchmarks"), str(ROOT / "tests")]
import sweep  # noqa: E402
import sweep_packages as sp  # noqa: E402

ZOO = 'pip install torch==2.14.1 torchvision==0.29.1, then pip install -e ".[test,real,zoo]"'


def test_every_attention_class_of_a_package_is_enumerated_and_a_command_line_is_not_run():
    pytest.importorskip("vit_pytorch", reason=f"vit-pytorch is not installed (the zoo extra): {ZOO}")
    pytest.importorskip("whisper", reason=f"openai-whisper is not installed (the zoo extra): {ZOO}")
    names = sp.package_types("vit_pytorch")
    assert {"vit:Attention", "deepvit:Attention", "na_vit:Attention"} <= set(names), names
    assert all(n.split(":")[1].endswith("Attention") for n in names), names
    assert sp.package_types("whisper") == ["model:MultiHeadAttention"]  # whisper.__main__ parses sys.argv: not run


@pytest.mark.parametrize("name, verdict, declared", [
    ("vit:Attention", "passed", ""),
    ("na_vit:Attention", "inconclusive", "mask='key_keep': passed"),  # True = may attend, one per key
    # over (B, C, H, W) pixels with convolutions for projections: the usage error names adapters.image, which passes
    ("scalable_vit:ScalableSelfAttention", "usage error", "adapters.image(layer): passed"),
    ("twins_svt:GlobalAttention", "usage error", "adapters.image(layer), seq_len=196: passed"),  # 7 x 7 key convs
    # the log of a sigmoid gate added to q·k at its own value (tests/test_gated_scores.py): inconclusive before
    ("simple_vit_with_sparse_gating:Attention", "passed", ""),
])
def test_a_row_of_the_vit_pytorch_sweep(name, verdict, declared):
    pytest.importorskip("vit_pytorch", reason=f"vit-pytorch is not installed (the zoo extra): {ZOO}")
    types, run_one = sweep.LIBRARIES["vit_pytorch"]
    row = sweep.in_child(run_one, name, 240.0, bugs=False)
    assert (row.built, row.verdict, row.declared) == (True, verdict, declared), row


def test_whispers_known_failure_is_confirmed_by_a_plain_script():
    """sweep_packages.KNOWN's reason, outside the audit: on whisper's SDPA path a mask that blocks the last two keys
    (not causal) gives exactly the causal mask's output, and the explicit path, which adds the mask, differs."""
    pytest.importorskip("whisper", reason=f"openai-whisper is not installed (the zoo extra): {ZOO}")
    import torch
    from whisper.model import MultiHeadAttention

    assert "model:MultiHeadAttention" in sweep.KNOWN
    torch.manual_seed(0)
    layer = MultiHeadAttention(16, 2).eval()
    x = torch.randn(1, 6, 16)
    padding = torch.zeros(6, 6)
    padding[:, -2:] = float("-inf")  # the last two keys blocked for every query: additive, as whisper takes it
    causal = torch.full((6, 6), float("-inf")).triu(1)
    try:
        with torch.no_grad():
            sdpa_padding, sdpa_causal = layer(x, mask=padding)[0], layer(x, mask=causal)[0]
            MultiHeadAttention.use_sdpa = False
            explicit_padding = layer(x, mask=padding)[0]
    finally:
        MultiHeadAttention.use_sdpa = True
    assert torch.equal(sdpa_padding, sdpa_causal)  # the mask's values unread
    assert float((sdpa_padding - explicit_padding).abs().max()) > 0.1  # the path that reads them gives another output


def test_any_installed_package_is_swept_by_its_import_name_and_one_not_installed_is_refused():
    """Beyond the zoo's four: a package's version read from the distribution that installs it (pytest's own here), and
    a name that is neither a library of the sweep's nor an installed package an error that says what to do."""
    assert sp.package_version("_pytest") == sp.package_version("pytest")  # `_pytest` is installed by `pytest`
    with pytest.raises(SystemExit):
        sweep.main(["no_such_package_here"])


def test_windowed_bucketed_and_segmented_layers_are_built_with_sizes_that_divide_the_tokens():
    """A size these packages' layers require with no default (a window, a bucket, a segment) is one that divides the
    sweep's T tokens, so that those attentions are in the population rather than rows "not built"."""

    class Windowed:
        def __init__(self, dim, heads, window_size, bucket_size, max_seq_len):
            pass

    filled = sp._filled(Windowed, sp.TINY, sp.PACKAGE_REQUIRED)
    assert filled["window_size"] == filled["bucket_size"] == sp.WINDOW and sp.T % sp.WINDOW == 0, filled
    assert filled["max_seq_len"] >= sp.T, filled


def test_the_known_failures_of_packages_beyond_the_zoo_by_plain_scripts():
    """KNOWN's reasons for packages swept by name (not in any extra: `pip install linear-attention-transformer==0.19.1
    mmdit==0.3.0 nGPT-pytorch==0.2.16 nystrom-attention==0.0.14` to run this), each outside the audit."""
    import torch

    pytest.importorskip("linear_attention_transformer", reason="pip install linear-attention-transformer==0.19.1")
    for name in ("mmdit", "nGPT_pytorch", "nystrom_attention"):
        pytest.importorskip(name, reason=f"{name} is not installed: pip install it to confirm its KNOWN reason")
    from linear_attention_transformer.linear_attention_transformer import linear_attn

    torch.manual_seed(0)
    out = linear_attn(torch.randn(2, 4, 16, 8), torch.randn(2, 4, 16, 8), torch.ones(2, 4, 16, 8))
    assert torch.allclose(out, torch.full_like(out, 8 ** -0.5), atol=1e-5)  # a distribution over keys gives 1
    x = torch.randn(2, 16, 32)
    assert sp.package_build("mmdit", "adaptive_attention:AdaptiveAttention")(x).shape == (2, 16, 128)  # 4 heads x 32
    for name in ("nTransformer:Attention", "nGPTExperimental:Attention"):
        with pytest.raises(RuntimeError, match="attn_mask should not be set when is_causal=True"):
            sp.package_build("nGPT_pytorch", name)(x, mask=torch.ones(2, 16, dtype=torch.bool))
    layer = sp.package_build("nystrom_attention", "nystrom_attention:NystromAttention")
    with torch.no_grad():
        moved = x.clone()
        moved[1] *= 1000
        assert not torch.allclose(layer(x)[0], layer(moved)[0], atol=1e-5)  # sequence 0 moved by sequence 1


def test_sinkhorns_known_failure_is_confirmed_by_a_plain_script():
    """KNOWN's reason for Sinkhorn's self-attention (`pip install sinkhorn-transformer==0.11.4` to run this): with
    the last 4 of 16 tokens masked, changing only them moves the kept tokens' outputs, outside the audit."""
    pytest.importorskip("sinkhorn_transformer", reason="pip install sinkhorn-transformer==0.11.4")
    layer = sp.package_build("sinkhorn_transformer", "sinkhorn_transformer:SinkhornSelfAttention")
    moved, kept, _ = _padded_tokens_moved(layer, lambda padded: padded * 1000)
    assert moved > 0.1 * kept


def test_perceivers_known_failure_is_confirmed_by_a_plain_script():
    """KNOWN's reason for perceiver-pytorch's experimental LinearAttention (`pip install perceiver-pytorch==0.11.0`
    to run this): token 5's values changed alone (the last third of `to_qkv`'s output) move output row 5 only."""
    import torch

    pytest.importorskip("perceiver_pytorch", reason="pip install perceiver-pytorch==0.11.0")
    layer = sp.package_build("perceiver_pytorch", "experimental:LinearAttention")
    third = layer.to_qkv.out_features // 3

    def run(moved: bool):
        def hook(module, args, out):
            if moved:
                out = out.clone()
                out[:, 5, 2 * third:] += 1.0
            return out

        handle = layer.to_qkv.register_forward_hook(hook)
        try:
            with torch.no_grad():
                return layer(torch.randn(2, 16, 32, generator=torch.Generator().manual_seed(0)))
        finally:
            handle.remove()

    rows = ((run(True) - run(False)).abs().amax(-1) > 1e-6).nonzero()[:, 1].unique().tolist()
    assert rows == [5], rows


PRIMERS = ("transformers.primer_ez:MultiDConvHeadAttention", "transformers.primer_ez.variations:MultiDPHConvHeadAttention",
           "transformers.primer_ez.variations:MultiDSharedConvHeadAttention",
           "transformers.primer_ez.efficient:MultiDConvHeadAttention")


@pytest.mark.parametrize("name", PRIMERS)
def test_primers_known_failure_is_confirmed_by_a_plain_script(name):
    """KNOWN's reason for labml-nn's Primer EZ attention (`pip install labml-nn==0.5.1 labml==0.4.168` to run this),
    each of its four variants (the last writes its convolution by hand, as shifted slices):
    sequence-first tokens, the queries left as they are and only the keys and values of tokens 0 and 1 changed, which
    the mask blocks for every query: the outputs move (the convolution over the keys carries them into keys 2 and 3).
    Padding at the end (the last 2 keys blocked for every query, changed) and a causal mask (the tokens after 10
    changed: the outputs before them) move nothing."""
    import torch

    pytest.importorskip("labml_nn", reason="pip install labml-nn==0.5.1 labml==0.4.168")
    assert name in sp.KNOWN
    layer = sp.package_build("labml_nn", name)
    T, B = 16, 2
    x = torch.randn(T, B, 32, generator=torch.Generator().manual_seed(0))

    def moved(rows):
        y = x.clone()
        y[rows] *= 1000
        return y

    def blocked(keys):
        mask = torch.ones(T, T, B, dtype=torch.bool)
        mask[:, keys] = False
        return mask

    def change(query, memory, mask):  # the largest change of any output row from the layer on x, under `mask`
        with torch.no_grad():
            return (layer(query=query, key=memory, value=memory, mask=mask)
                    - layer(query=x, key=x, value=x, mask=mask)).abs().amax(dim=(1, 2))

    leak = change(x, moved(slice(0, 2)), blocked(slice(0, 2)))
    assert float(leak.min()) > 1e-3, leak  # every query's output moves, though keys 0 and 1 are blocked for all
    assert float(change(x, moved(slice(T - 2, T)), blocked(slice(T - 2, T))).max()) < 1e-5
    causal = torch.ones(T, T).tril().bool()[..., None].expand(T, T, B)
    assert float(change(moved(slice(10, T)), moved(slice(10, T)), causal)[:10].max()) < 1e-5


def test_routings_known_failure_is_confirmed_by_a_plain_script():
    """KNOWN's reason for the Routing Transformer's self-attention (`pip install routing-transformer==1.6.1` to run
    this): with the last 4 of 16 tokens masked, redrawing only them moves the kept tokens' outputs."""
    import torch

    pytest.importorskip("routing_transformer", reason="pip install routing-transformer==1.6.1")
    layer = sp.package_build("routing_transformer", "routing_transformer:SelfAttention")
    moved, _, everything = _padded_tokens_moved(layer, lambda padded: torch.randn(padded.shape))
    assert moved > 0.1 * everything


def _padded_tokens_moved(layer, change) -> tuple[float, float, float]:
    """The last 4 of 16 tokens, which `input_mask` blocks, changed alone (`change(those tokens)`): (how far the 12 kept
    tokens' outputs moved at most, their largest output, the largest output of all; a layer's first output where it
    returns more)."""
    import torch

    torch.manual_seed(0)
    x = torch.randn(2, 16, 32)
    keep = (torch.arange(16) < 12).expand(2, 16)
    moved = x.clone()
    moved[:, 12:] = change(x[:, 12:])
    with torch.no_grad():
        kept, changed = (layer(t, input_mask=keep) for t in (x, moved))
    kept, changed = (t[0] if isinstance(t, tuple) else t for t in (kept, changed))
    return (float((kept[:, :12] - changed[:, :12]).abs().max()), float(kept[:, :12].abs().max()),
            float(kept.abs().max()))
