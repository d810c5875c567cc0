"""Pins for the model wing's numbers and branches that `benchmarks/mutations.py` found no test depending on (issue 37,
its second sample, seed 777, and every mutant of gradients.py, backends.py and causality.py): gradient_flow,
backend_parity, prefix_causality, padding_invariance and the two-sided window.
As in tests/test_pins.py, a case just inside and one just outside each constant or branch, the constants quoted as
literals on purpose; small models (one or two blocks, 16 wide), so the file runs in a few seconds.
"""

from __future__ import annotations

import pytest
import torch

import diagnostics
from buggy_variants.teaching_model import ProtocolGPT, TinyGPT
from correct import MultiHeadAttention
from diagnostics._guard import seed_rng
from diagnostics.model.gradients import input_embedding
from diagnostics.model.window import two_sided_window


def model_result(model, detector: str, **kw):
    return diagnostics.audit_model(model, detectors=[detector], **kw).result(detector)


class ReadsAhead(TinyGPT):
    """TinyGPT whose embeddings take `gain` x the next position's before the first block: a leak of the future into
    the past whose gradient, relative to the largest, is about 0.57 x `gain` (measured on this model at seed 0:
    1.71e-12 for 3e-12), far below what the float32 forward can show."""

    def __init__(self, gain: float):
        seed_rng(0)
        super().__init__(n_layer=1, d_model=16, num_heads=2)
        self.gain = gain

    def forward(self, input_ids):
        B, T = input_ids.shape  # batch, sequence length
        x = self.wte(input_ids) + self.wpe(torch.arange(T))  # (B, T, D)
        ahead = torch.cat([x[:, 1:], torch.zeros_like(x[:, :1])], 1)  # (B, T, D): position t holds t + 1's
        x = x + self.gain * ahead
        for block in self.h:
            x = block(x)
        return self.lm_head(self.ln_f(x))


@pytest.mark.parametrize("gain, expected", [(6e-12, "fail"), (6e-13, "pass")])
def test_gradient_flow_reads_a_leak_above_1e_12_of_the_largest_gradient_and_not_below(gain, expected):
    """model/gradients.py: `later > 1e-12 * max(...)`. A gradient to later embeddings of about 3.4e-12 of the
    largest fails (it would pass at 1e-11), one of about 3.4e-13 passes as rounding (it would fail at 1e-13)."""
    result = model_result(ReadsAhead(gain), "gradient_flow")
    assert result.verdict == expected, result
    if expected == "fail":
        assert result.message.startswith("the gradient lets the future in"), result


@pytest.mark.parametrize("causal", [True, False])
def test_gradient_flow_says_it_measured_the_future_only_for_a_causal_model(causal):
    """model/gradients.py: the pass message claims "no output sends gradient to later input embeddings" only where
    that was measured: a causal model (`ctx.causal and "x" in leaf`), not a model audited as bidirectional."""
    result = model_result(ReadsAhead(0.0), "gradient_flow", causal=causal)
    assert result.verdict == "pass", result
    assert result.message.endswith("and no output sends gradient to later input embeddings") is causal, result


class _Config:
    _attn_implementation = "eager"


def posing_as_hugging_face(*, takes_mask: bool, sdpa_pads_with_zeros: bool = False):
    """ProtocolGPT posing as a Hugging Face model that can switch its attention implementation (as
    tests/test_error_paths.py's `switchable`), recording the `attention_mask` of every call in `calls` (a class
    attribute: the twin backend_parity deep-copies records into the same list). `takes_mask=False`: its forward
    takes the token ids only (no padding mask to give it). `sdpa_pads_with_zeros`: its sdpa path returns zeros at
    the positions the padding mask hides (what a padded position holds is not defined)."""

    class Posing(ProtocolGPT):
        calls: list = []

        def __init__(self):
            torch.manual_seed(0)
            super().__init__(n_layer=1, d_model=16, num_heads=2)
            self.config = _Config()

        def set_attn_implementation(self, name):
            self.config = _Config()
            self.config._attn_implementation = name

        def forward(self, input_ids, attention_mask=None):
            self.calls.append(attention_mask)
            out = super().forward(input_ids, attention_mask)  # (B, T, vocab)
            if sdpa_pads_with_zeros and attention_mask is not None and self.config._attn_implementation == "sdpa":
                out = out.masked_fill(attention_mask[..., None] == 0, 0.0)
            return out

    class PosingWithoutMask(Posing):
        def forward(self, input_ids):
            return super().forward(input_ids)

    model = Posing() if takes_mask else PosingWithoutMask()
    model.__class__.__module__ = "transformers.models.posing.modeling_posing"
    return model


@pytest.mark.parametrize("seq_len, padded", [(3, [[1, 1, 1], [1, 1, 0]]), (2, None)])
def test_backend_parity_pads_the_second_row_from_3_tokens(seq_len, padded):
    """model/backends.py: `T >= 3` (with a padding mask to give): at 3 tokens both implementations run a batch whose
    second row ends in padding; at 2 no mask is passed."""
    model = posing_as_hugging_face(takes_mask=True)
    result = model_result(model, "backend_parity", seq_len=seq_len)
    assert result.verdict == "pass", result
    masks = [m.tolist() if m is not None else None for m in model.calls]
    assert padded in masks and all(m in (None, padded) for m in masks), masks


def test_backend_parity_of_a_model_without_a_padding_mask_compares_unpadded_rows():
    """model/backends.py: `runner.padding_name is not None and ...`: a model whose forward takes no attention mask
    is compared on the rows as they are, not handed a mask it has no argument for."""
    model = posing_as_hugging_face(takes_mask=False)
    result = model_result(model, "backend_parity")
    assert (result.verdict, result.message) == ("pass", "eager and sdpa agree"), result
    assert model.calls and all(m is None for m in model.calls)


class Peeks(torch.nn.Module):
    """Before a block's MLP or norm, a leak of the future: "every": position t takes t + 1's features, at every t;
    "T-2": at T - 2 only; "0 from T-1": position 0 takes the last position's."""

    def __init__(self, where: str):
        super().__init__()
        self.where = where

    def forward(self, x):
        B, T, D = x.shape  # batch, sequence length, d_model
        if self.where == "0 from T-1":
            return torch.cat([x[:, :1] + x[:, -1:], x[:, 1:]], 1)  # (B, T, D)
        ahead = torch.cat([x[:, 1:], torch.zeros_like(x[:, :1])], 1)  # (B, T, D): position t holds t + 1's
        if self.where == "T-2":
            ahead[:, :T - 2] = 0
        return x + ahead


def peeking(where: str) -> TinyGPT:
    """TinyGPT (2 blocks) with a `Peeks(where)` before block h.0's MLP, or for "0 from T-1" before its first norm
    (there the last position's features are its embeddings: the same token in every cut's row)."""
    seed_rng(0)
    model = TinyGPT(n_layer=2, d_model=16, num_heads=2)
    if where == "0 from T-1":
        model.h[0].ln_1 = torch.nn.Sequential(Peeks(where), model.h[0].ln_1)
    else:
        model.h[0].mlp = torch.nn.Sequential(Peeks(where), model.h[0].mlp)
    return model


@pytest.mark.parametrize("where", ["every", "T-2"])
def test_prefix_causality_names_the_first_module_any_cut_reaches_not_only_the_middle_one(where):
    """model/causality.py: the first module whose past outputs moved (`first is None and ...`: not the last, h.1's
    attention and block move too) is looked for at every cut (0, T // 2, T - 2). A leak of T - 1 into T - 2 moves
    no past output at the middle cut (its reach there is 0) and is still placed in block h.0, as a leak at every
    position is (reach > 0)."""
    report = diagnostics.audit_model(peeking(where), detectors=["prefix_causality"])
    result = report.result("prefix_causality")
    assert (result.verdict, result.layer) == ("fail", "h.0"), result
    reach = report.readings["prefix_reach"]
    assert reach["reach"]["h.0.attn"] == 0 and (reach["blocks"]["h.0"] == 0) is (where == "T-2"), reach


def test_prefix_causality_quotes_the_first_cut_that_reached_the_greatest_change():
    """model/causality.py: `float(past.max()) > worst`: where every cut moves position 0 by the same amount (it reads
    the last token's embeddings, which every cut replaces by the same token's), the evidence quotes the first cut, 0;
    `>=` would quote the last, 14."""
    result = diagnostics.audit_model(peeking("0 from T-1"), detectors=["prefix_causality"]).result("prefix_causality")
    assert result.verdict == "fail" and "at t=0 when only t>0 was changed" in result.evidence, result


class Seq2Seq(torch.nn.Module):
    """An encoder-decoder as `input_embedding(decoder=True)` reads it: `get_decoder` returns `decoder`, or raises
    when that is "raises"; the decoder has an embedding of its own unless it is None or the model itself."""

    def __init__(self, decoder):
        super().__init__()
        self.shared = torch.nn.Embedding(8, 4)
        self.decoder = decoder if decoder != "raises" else None

    def get_decoder(self):
        if self.decoder is None:
            raise NotImplementedError("no decoder")
        return self.decoder


def test_input_embedding_of_an_encoder_decoder_is_its_decoders_own_else_the_models():
    """model/gradients.py `input_embedding`: `isinstance(inner, nn.Module) and inner is not model`: a decoder with an
    embedding of its own gives that one; a getter that raises, returns something that is not a module or returns
    the model itself gives the model's own (the first nn.Embedding)."""
    own = torch.nn.Sequential(torch.nn.Embedding(8, 4))
    assert input_embedding(Seq2Seq(own), decoder=True) is own[0]
    for decoder in ("raises", "not a module"):
        model = Seq2Seq(decoder)
        assert input_embedding(model, decoder=True) is model.shared
    itself = Seq2Seq(None)
    itself.decoder = itself
    assert input_embedding(itself, decoder=True) is itself.shared


class PositionsFirst(TinyGPT):
    """TinyGPT whose first nn.Embedding is its position table (wte registered after it), so the gradient's leaf is
    looked for at an output of (T, D), not (B, T, D)."""

    def __init__(self):
        seed_rng(0)
        super().__init__(n_layer=1, d_model=16, num_heads=2)
        wte = self.wte
        del self.wte
        self.wte = wte


class TableEmbedding(TinyGPT):
    """TinyGPT whose embeddings are bare parameters indexed by the ids and positions: no nn.Embedding to take a
    leaf at."""

    def __init__(self):
        seed_rng(0)
        super().__init__(n_layer=1, d_model=16, num_heads=2)
        self.tokens = torch.nn.Parameter(self.wte.weight.detach().clone())
        self.positions = torch.nn.Parameter(self.wpe.weight.detach().clone())
        del self.wte, self.wpe

    def forward(self, input_ids):
        B, T = input_ids.shape  # batch, sequence length
        x = self.tokens[input_ids] + self.positions[:T]  # (B, T, D)
        for block in self.h:
            x = block(x)
        return self.lm_head(self.ln_f(x))


@pytest.mark.parametrize("make, measured", [(lambda: ReadsAhead(0.0), True), (PositionsFirst, False),
                                            (TableEmbedding, False)],
                         ids=["token embedding", "position table first", "no nn.Embedding"])
def test_gradient_flow_takes_its_leaf_only_at_token_embeddings_of_the_inputs_shape(make, measured):
    """model/gradients.py: the hook takes a leaf only from a float output of (B, T, ...) (`isinstance(...) and
    out.is_floating_point() and out.shape[:2] == seq.shape[:2]`), and token ids without an embedding module give no
    leaf (`emb is None and seq.is_floating_point()`): each of these causal models passes, the future measured only
    where the leaf is the token embeddings (a position table's (T, D) taken as the leaf reads as a leak, ids made
    a leaf raise)."""
    result = model_result(make(), "gradient_flow", example=torch.randint(0, 64, (2, 16)))
    assert result.verdict == "pass", result
    assert result.message.endswith("and no output sends gradient to later input embeddings") is measured, result


@pytest.mark.parametrize("zeros", [True, False])
def test_backend_parity_compares_the_positions_the_padding_mask_keeps_only(zeros):
    """model/backends.py: `keep.shape == mine.shape[:2]`: implementations compared at the unmasked positions, so an
    sdpa path that leaves zeros where the padding mask hides the tokens agrees with eager as the plain one does."""
    result = model_result(posing_as_hugging_face(takes_mask=True, sdpa_pads_with_zeros=zeros), "backend_parity")
    assert (result.verdict, result.message) == ("pass", "eager and sdpa agree"), result


class QuietLater(TinyGPT):
    """TinyGPT whose logits are zero at positions T // 2 + 1 .. T - 2: changing the later tokens moves the last
    output and not those (a causal model, measured)."""

    def __init__(self):
        seed_rng(0)
        super().__init__(n_layer=1, d_model=16, num_heads=2)

    def forward(self, input_ids):
        T = input_ids.shape[1]
        keep = torch.ones(T, 1)
        keep[T // 2 + 1:-1] = 0
        return super().forward(input_ids) * keep  # (B, T, vocab)


def test_prefix_causality_measures_a_model_once_any_later_output_moved_at_every_cut():
    """model/causality.py `moved_own`: the verdict is "not measured" only where some cut moved no later output
    (`> tol).any()` at every cut); one later output moving at each cut (the last) is enough to pass, as the
    plain model does."""
    for model in (QuietLater(), ReadsAhead(0.0)):
        result = model_result(model, "prefix_causality")
        assert result.verdict == "pass", result


class SideReading(TinyGPT):
    """TinyGPT with a third attention module of its own kind that it runs only on a side reading it discards: on the
    batch's first row alone (`rows`), or on the first half of the positions (`half`). Its outputs are never one per
    row and position of the batch, so the reach per layer leaves it out."""

    def __init__(self, side: str):
        seed_rng(0)
        super().__init__(n_layer=2, d_model=16, num_heads=2)
        self.side, self.extra = side, MultiHeadAttention(16, 2)

    def forward(self, input_ids):
        T = input_ids.shape[1]
        x = self.wte(input_ids) + self.wpe(torch.arange(T))  # (B, T, D)
        self.extra(x[:1] if self.side == "rows" else x[:, :T // 2])  # (1, T, D) or (B, T / 2, D), discarded
        for block in self.h:
            x = block(x)
        return self.lm_head(self.ln_f(x))


class OneBlockTwice(TinyGPT):
    """TinyGPT applying its one block twice (weights shared across depth, as ALBERT does): each call of the block and
    of its attention is one per row and position, taken in its round (its first cycle's reach is shown)."""

    def __init__(self):
        seed_rng(0)
        super().__init__(n_layer=1, d_model=16, num_heads=2)

    def forward(self, input_ids):
        T = input_ids.shape[1]
        x = self.wte(input_ids) + self.wpe(torch.arange(T))  # (B, T, D)
        x = self.h[0](self.h[0](x))
        return self.lm_head(self.ln_f(x))


LAYERS, BLOCKS = {"h.0.attn": 0, "h.1.attn": 0}, {"h.0": 0, "h.1": 0}


@pytest.mark.parametrize("make, reach, blocks", [(lambda: SideReading("rows"), LAYERS, BLOCKS),
                                                 (lambda: SideReading("half"), LAYERS, BLOCKS),
                                                 (OneBlockTwice, {"h.0.attn": 0}, {"h.0": 0})],
                         ids=["another batch size", "other positions", "one block twice"])
def test_prefix_causality_leaves_out_a_layer_whose_outputs_are_not_one_per_row_and_position(make, reach, blocks):
    """model/causality.py: `layer_out is None or layer_out.shape[0] != batch.shape[0] or layer_out.shape[1] != T`: a
    module whose only call is on another batch size or another number of positions is left out of the reach per
    layer, and the model is measured as usual; a block called twice is measured in each round (before rounds, its
    calls joined into 2T positions and it was left out)."""
    report = diagnostics.audit_model(make(), detectors=["prefix_causality"])
    assert report.result("prefix_causality").verdict == "pass", report.result("prefix_causality")
    assert (report.readings["prefix_reach"]["reach"], report.readings["prefix_reach"]["blocks"]) == (reach, blocks)


class PaddedWithoutPositions(ProtocolGPT):
    """ProtocolGPT whose forward takes a padding mask and no position ids."""

    def forward(self, input_ids, attention_mask=None):
        return super().forward(input_ids, attention_mask)


@pytest.mark.parametrize("positions", [True, False])
def test_padding_invariance_says_left_padding_was_not_checked_only_without_position_ids(positions):
    """model/padding.py `if not left`: the evidence says left padding was not checked where the forward takes no
    position_ids (left-padded tokens would sit at other positions), and not where it was checked."""
    torch.manual_seed(0)
    model = (ProtocolGPT if positions else PaddedWithoutPositions)(n_layer=1, d_model=16, num_heads=2)
    result = model_result(model, "padding_invariance")
    assert result.verdict == "pass", result
    assert ("left padding not checked" in result.evidence) is not positions, result


def test_a_two_sided_window_allows_w_keys_on_each_side_and_not_w_plus_1():
    """model/window.py `two_sided_window`: |q - kv| <= w (its behaviour in a model audit is tested with
    transformers' encoders, tests/test_model_patterns.py, which skip without them)."""
    allowed = two_sided_window(2).allowed(1, 6, 6)[0]  # (Tq, Tk)
    q, kv = torch.arange(6)[:, None], torch.arange(6)[None]  # (Tq, 1), (1, Tk)
    assert torch.equal(allowed, (q - kv).abs() <= 2)
    assert bool(allowed[3, 1]) and bool(allowed[3, 5]) and not bool(allowed[3, 0]) and not bool(allowed[0, 3])


class RootGain(MultiHeadAttention):
    """The reference times a learned per-feature gain's square root, one entry of the gain at 0 (`zero=True`): that
    entry's gradient is NaN (0 x inf), every other entry's finite."""

    def __init__(self, *, zero: bool):
        super().__init__(16, 2, causal=True)
        self.gain = torch.nn.Parameter(torch.ones(16))
        if zero:
            self.gain.data[0] = 0.0

    def forward(self, *args, **kwargs):
        out, weights = super().forward(*args, **kwargs)
        return out * self.gain.sqrt(), weights


@pytest.mark.parametrize("zero", [True, False])
def test_gradient_flow_fails_a_parameter_with_one_non_finite_gradient_entry(zero):
    """model/gradients.py: `not bool(torch.isfinite(g).all())`: one NaN entry among finite ones makes a parameter's
    gradient non-finite; its twin with the entry at 1 passes."""
    seed_rng(0)
    model = TinyGPT(n_layer=1, d_model=16, num_heads=2)
    model.h[0].attn = RootGain(zero=zero)
    result = model_result(model, "gradient_flow")
    assert (result.verdict, result.message.startswith("attention parameters get non-finite gradients")) == \
        (("fail", True) if zero else ("pass", False)), result
    if zero:
        assert result.evidence == "h.0.attn.gain", result


@pytest.mark.parametrize("gain, expected", [(1.0, "fail"), (0.0, "pass")])
def test_gradient_flow_measures_the_future_from_2_tokens(gain, expected):
    """model/gradients.py: `seq.shape[1] >= 2`: at 2 tokens (the shortest audit) the first output's gradient to the
    second token's embeddings is read: a leak fails there, its twin without one passes."""
    result = model_result(ReadsAhead(gain), "gradient_flow", seq_len=2)
    assert result.verdict == expected, result
    assert result.message.endswith("and no output sends gradient to later input embeddings") is (expected == "pass")


class UnusedParameters(MultiHeadAttention):
    """The reference with `n` parameters of its own that the forward never reads (no gradient)."""

    def __init__(self, n: int):
        super().__init__(16, 2, causal=True)
        self.unused = torch.nn.ParameterList(torch.nn.Parameter(torch.zeros(1)) for _ in range(n))


@pytest.mark.parametrize("n, more", [(8, False), (9, True)])
def test_gradient_flow_lists_8_parameters_without_gradient_and_marks_more(n, more):
    """model/gradients.py: `' ...' if len(missing) > 8`: the evidence lists the first 8 parameters without a
    gradient, and says there are more only past 8."""
    seed_rng(0)
    model = TinyGPT(n_layer=1, d_model=16, num_heads=2)
    model.h[0].attn = UnusedParameters(n)
    result = model_result(model, "gradient_flow")
    assert (result.verdict, result.message) == ("fail", f"{n} of {n + 4} attention parameters get no gradient"), result
    assert ("h.0.attn.unused.7 ..." in result.evidence) is more and "h.0.attn.unused.7" in result.evidence, result


class DetachedAttention(MultiHeadAttention):
    """The reference attention returning its output detached (a real bug: nothing behind it gets a gradient)."""

    def forward(self, *args, **kwargs):
        out, weights = super().forward(*args, **kwargs)
        return out.detach(), weights


@pytest.mark.parametrize("detached", [False, True])
def test_gradient_flow_fails_an_attention_module_whose_own_output_is_detached(detached):
    """model/gradients.py's output hook keeps a module's first output only where it requires grad
    (`path not in outputs and isinstance(o, Tensor) and o.requires_grad`): a module that detaches its own output sends
    no gradient to its parameters, a fail naming them (with the first `and` made `or`, the detached output is kept and
    autograd raises: the detector crashes); the same weights undetached pass."""
    seed_rng(0)
    model = TinyGPT(n_layer=1, d_model=16, num_heads=2)
    if detached:
        attention = DetachedAttention(16, 2, causal=True)
        attention.load_state_dict(model.h[0].attn.state_dict())
        model.h[0].attn = attention
    result = model_result(model, "gradient_flow")
    if detached:
        assert result.verdict == "fail" and result.message == "4 of 4 attention parameters get no gradient", result
    else:
        assert result.verdict == "pass", result
