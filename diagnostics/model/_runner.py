"""Calling the model: `Runner` calls it by keyword with a main sequence input (token ids or embeddings, (B, T[, D]))
and the options its forward takes, in Hugging Face's keyword protocol, and counts the forwards.

Plain (non-Hugging Face) models take part in padding, position and cache checks through the same protocol:
`forward(input_ids, attention_mask=None, position_ids=None, past_key_values=None, use_cache=False)` with
`attention_mask` (B, T) 1 = real token, returning logits, or `(logits, cache)` when `use_cache=True`.
"""

from __future__ import annotations

import inspect

import torch
from torch import Tensor, nn

from .._errors import expect
from .._guard import untouched
from .._registry import phrase
from .._subject import CONTEXT_NAMES

MAIN_INPUT_NAMES = ("input_ids", "idx", "tokens", "ids", "x", "src", "tgt", "inputs_embeds", "pixel_values",
                    "input", "inputs")
# Inputs that are no sequence of the model's positions: images, a waveform's samples, a spectrogram's frames (the
# outputs do not line up with them one to one: the checks that cut, pad and pack positions do not apply)
SIGNAL_NAMES = ("pixel_values", "input_values", "input_features")
# What a config calls the feature bins of a speech model's input_features (Whisper's num_mel_bins, Speech2Text's
# input_feat_per_channel, Wav2Vec2-BERT's feature_size, ...)
FEATURE_SIZE_NAMES = ("num_mel_bins", "feature_size", "input_feat_per_channel", "input_feat_size", "n_mels",
                      "num_mel_filters", "input_dim", "mel_bins")
DEFAULT_IMAGE_SIZE = 64  # pixels for a vision model whose config declares no size (a convolutional backbone, DETR)
LARGER_IMAGE_SIZES = (128, 224)  # tried in turn where a model declares no size and raises at DEFAULT_IMAGE_SIZE
DEFAULT_SAMPLES = 16000  # a waveform's samples where nothing declares fewer: one second at 16 kHz
# An example's entries aligned with the tested sequence: the checks cut and pad the sequence, and build these
ALIGNED_NAMES = ("attention_mask", "position_ids", "token_type_ids", "decoder_attention_mask", "decoder_position_ids",
                 "cache_position")


def timm_image_size(model: nn.Module) -> tuple:
    """(image size, channels, where it was read) a timm model declares: the size it was built at (`img_size` on the
    model or on one of its children: ViT's patch_embed, TNT's pixel_embed), else its configuration's `input_size`
    (C, H, W: `pretrained_cfg`, for the models that keep no `img_size`: MetaFormer, DaViT, LeViT, Hiera, ...);
    (None, 3, "") if none says. The configuration's size holds where any size runs (`fixed_input_size` false); on a
    model of a fixed size it is the size timm's builder built it at (it passes `input_size` as `img_size`) unless
    the caller passed another `img_size`, so that one is marked "fixed" for the caller to try first."""
    cfg = getattr(model, "pretrained_cfg", None) or getattr(model, "default_cfg", None) or {}
    declared = cfg.get("input_size") if isinstance(cfg, dict) else None
    declared = declared if isinstance(declared, (tuple, list)) and len(declared) == 3 else None
    channels = int(declared[0]) if declared else 3
    children = dict(model.named_children())
    holders = [("patch_embed.", children.get("patch_embed")), ("", model),
               *((f"{name}.", child) for name, child in children.items() if name != "patch_embed")]
    for prefix, holder in holders:
        size = getattr(holder, "img_size", None)
        if isinstance(size, int) or (isinstance(size, (tuple, list)) and len(size) == 2):
            return size, channels, f"{type(model).__name__}'s {prefix}img_size"
    if declared is None:
        return None, 3, ""
    fixed = cfg.get("fixed_input_size") is not False
    return (tuple(int(v) for v in declared[1:]), channels,
            "its pretrained_cfg's input_size" + (" (fixed)" if fixed else ""))


def first_tensor(x):
    """The output tensor of whatever a model or module returns: a tensor, logits / last_hidden_state on a
    model output, or the first tensor of a dict, tuple or list, depth first (I-BERT's attention returns
    ((context, probs), scaling factor)); None if there is none."""
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
        for value in x.values():  # a backbone's feature_maps: a tuple of tensors is all it returns
            found = first_tensor(value) if isinstance(value, (tuple, list)) else None
            if found is not None:
                return found
    if isinstance(x, (tuple, list)):
        for value in x:
            found = first_tensor(value) if isinstance(value, (tuple, list)) else value
            if isinstance(found, Tensor):
                return found
    return None


def output_tensors(x) -> list[Tensor]:
    """Every floating tensor a model returned (a tensor, a model output's or dict's values, tuples and lists inside
    them), in order, each once: the outputs beside `first_tensor` (a pooled output, a second head's logits)."""
    found: list = []
    todo = [x]
    while todo:
        item = todo.pop(0)
        if isinstance(item, Tensor):
            if item.is_floating_point() and not any(item is f for f in found):
                found.append(item)
        elif isinstance(item, dict):
            todo.extend(item.values())
        elif isinstance(item, (tuple, list)):
            todo.extend(item)
    return found


def cache_of(x):
    """The cache a model returned with use_cache=True (a Cache object, or the second item of a tuple)."""
    for name in ("cache", "past_key_values"):  # transformers 5 names it `cache`, earlier versions past_key_values
        value = x.get(name) if isinstance(x, dict) else getattr(x, name, None)
        if value is not None and not isinstance(value, Tensor):
            return value
    if isinstance(x, (tuple, list)) and len(x) >= 2 and not isinstance(x[1], Tensor):
        return x[1]
    return None


def is_hf(model) -> bool:
    """A Hugging Face model: its class comes from transformers and it has a config."""
    return type(model).__module__.startswith("transformers.") and getattr(model, "config", None) is not None


def model_context(model) -> int | None:
    """The shortest context the model or its config declares (`_subject.CONTEXT_NAMES`), or None."""
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

    def __init__(self, model: nn.Module, example, *, seq_len: int | None, seed: int, options: dict | None = None):
        self.model = model
        self.options = dict(options or {})  # how the front end spells its options (phrase() knows example=)
        try:
            self.params = inspect.signature(model.forward).parameters
        except (TypeError, ValueError):
            self.params = {}
        self.takes_kwargs = any(p.kind == p.VAR_KEYWORD for p in self.params.values())
        self.kwargs_take_cache = True  # use_cache passes through **kwargs until the model refuses it (`__call__`)
        self.forwards = 0
        self.hf = is_hf(model)
        self.encoder_decoder = bool(getattr(getattr(model, "config", None), "is_encoder_decoder", False))
        self.fixed: dict = {}
        self.dropped: list[str] = []  # the example's per-position entries, which the checks build themselves
        self.vocab, self.special = 0, frozenset()  # the ids drawn, and the special ids kept out of them
        self.built_example = example is None  # the audit's own: a model that rejects it says nothing about itself
        self.chosen = ""  # what the audit chose where the model declares too little (said in the report's notes)
        self.size_declared = True  # False where the images' size is the audit's guess (DEFAULT_IMAGE_SIZE)
        self.main, inputs = self._example(example, seq_len, seed)
        self.inputs = inputs  # (B, T[, D]) or images
        self.sequence = self.main not in SIGNAL_NAMES and inputs.dim() in (2, 3) and (
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
        if self.vocab:
            return self.vocab  # read where the example was built
        config = getattr(self.model, "config", None)
        if self.hf:
            self.special = special_ids(config)
            config = config.get_text_config() if hasattr(config, "get_text_config") else config
        vocab = getattr(config, "vocab_size", None)
        if isinstance(vocab, int) and vocab > int(self.inputs.max()):
            return vocab
        emb = self._reached_table() or next((m for m in self.model.modules() if isinstance(m, nn.Embedding)), None)
        return emb.num_embeddings if emb is not None else int(self.inputs.max()) + 1

    def _reached_table(self) -> nn.Embedding | None:
        """The token table the example's main ids reach: the first nn.Embedding given them as they came, in a forward
        of the example's first row (its own ids: in range). Not the model's first table: with two id inputs (a token
        and an entity vocabulary) that may be the other input's, and ids drawn from a larger one than their own are
        out of range (IndexError on the CPU; on CUDA a device-side assert that ends the process)."""
        x = self.inputs[:1]
        found: list = []

        def hook(m, args):
            if not found and args and isinstance(args[0], Tensor) and args[0].shape == x.shape and \
                    (args[0] is x or bool((args[0] == x).all())):
                found.append(m)

        tables = [m for m in self.model.modules() if isinstance(m, nn.Embedding)]
        if len(tables) < 2:
            return tables[0] if tables else None
        handles = [m.register_forward_pre_hook(hook) for m in tables]
        kwargs = {n: (v[:1] if isinstance(v, Tensor) and v.dim() >= 1 else v) for n, v in self.fixed.items()}
        try:
            with untouched(self.model, x.device), torch.no_grad():
                self.model(**kwargs, **{self.main: x})
        except Exception:  # the user's model raised on its own example: model_runs says so
            pass
        finally:
            for h in handles:
                h.remove()
        return found[0] if found else None

    def _example(self, example, seq_len, seed):
        model = self.model
        gen = torch.Generator().manual_seed(seed + 1000003)
        names = [n for n in self.params if self.params[n].kind not in (inspect.Parameter.VAR_KEYWORD,
                                                                          inspect.Parameter.VAR_POSITIONAL)]
        first = names[0] if names else "input_ids"
        device, dtype = device_dtype(model)
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
               type(example).__name__, phrase("pass e.g. {example}torch.randint(vocab_size, (2, 16))", self.options))
        config = getattr(model, "config", None)
        T = seq_len or min(16, model_context(model) or 16)
        if isinstance(model, (nn.TransformerEncoder, nn.TransformerDecoder)):
            D = model.layers[0].self_attn.embed_dim
            first_layer = model.layers[0]
            shape = (2, T, D) if first_layer.self_attn.batch_first else (T, 2, D)
            expect(first_layer.self_attn.batch_first, "torch transformer layers built with batch_first=True",
                   "batch_first=False", phrase("build the layers with batch_first=True, or pass {example}... and "
                                               "audit through a module of your own that takes (B, T, D)", self.options))
            if isinstance(model, nn.TransformerDecoder):
                self.fixed["memory"] = torch.randn(2, T, D, generator=gen).to(device, dtype)
            return first, torch.randn(*shape, generator=gen).to(device, dtype)
        if self.hf:
            return self._declared_example(config, T, gen, device, dtype)
        vocab = getattr(config, "vocab_size", None) if config is not None else None
        size = getattr(config, "image_size", None) if config is not None else None
        if isinstance(vocab, int) and vocab > 0 and size is None:
            self.vocab = vocab
            return first, self.draw_ids((2, T), gen).to(device)
        channels = getattr(config, "num_channels", 3) if config is not None else 3
        stale = ""
        if size is None and type(model).__module__.startswith("timm."):
            size, channels, source = timm_image_size(model)
            if source.endswith("(fixed)") and not self._runs_at(size, channels, device, dtype):
                # built at another img_size than its configuration says: the size is the caller's to give
                stale = f" (it did not run at {source[:-8]}, {size[0]} x {size[1]})"
                size = None
        if size is not None:
            h, w = (size, size) if isinstance(size, int) else tuple(size)
            return first, torch.randn(2, channels, h, w, generator=gen).to(device, dtype)
        emb = next((m for m in model.modules() if isinstance(m, nn.Embedding)), None)
        expect(emb is not None, phrase("{example}..., or a model whose inputs can be built (a Hugging Face model, "
                                       "an nn.Embedding for token ids, torch's TransformerEncoder/Decoder, a timm vision "
                                       "model)", self.options),
               f"{type(model).__name__} with none of these" + stale, self._example_hint())
        self.vocab = emb.num_embeddings
        return first, self.draw_ids((2, T), gen).to(device)

    def _runs_at(self, size, channels: int, device, dtype) -> bool:
        """Whether the model runs a forward of one image of `size` (a trial under the state guard). With gradients,
        as the audit's own forwards: a model that caches in eval mode (LeViT's attention biases) keeps no tensor cut
        from its parameters' graph by a trial that was the first to run."""
        try:
            with untouched(self.model, device):
                gen = torch.Generator().manual_seed(0)  # pixels that vary, as the audit's: no degenerate input
                self.model(torch.randn(1, channels, *size, generator=gen).to(device, dtype))
        except Exception:  # the user's model raised: that size is not the one it was built for
            return False
        return True

    def _example_hint(self) -> str:
        """How to pass an example, in the form the model's first layer reads: pixels for a model that starts with a
        convolution (a patch embedding, a stem), token ids otherwise."""
        first = next((m for m in self.model.modules() if next(m.children(), None) is None  # the first layer with
                      and next(m.parameters(), None) is not None), None)  # weights, not a holder of tables
        if isinstance(first, nn.modules.conv._ConvNd):
            path = next(n for n, m in self.model.named_modules() if m is first)
            spatial = ", ".join(("L",) if first.weight.dim() == 3 else ("T", "H", "W")[5 - first.weight.dim():])
            return phrase(f"pass {{example}}torch.randn(2, {first.in_channels}, {spatial}) at the size the model was "
                          f"built for: it starts with {type(first).__name__}({first.in_channels} -> "
                          f"{first.out_channels}) at {path}", self.options)
        return phrase("pass {example}torch.randint(vocab, (2, 16)) or a dict of the model's inputs", self.options)

    def _declared_example(self, config, T: int, gen, device, dtype):
        """`_declared_main`, with the forward's required inputs beside it (a patch grid's `spatial_shapes` and
        `pixel_attention_mask`: its pixels come as patches), else a usage error that names them; where the model
        raises on it, the other forms it may take (`_other_forms`: a pair of images, the declared frames, larger images
        where no size is declared, token ids beside or instead of a signal), the first it runs on. Not the
        pixels of a model that pairs text with images (CLIP's kind): its vision tower then reads no token and the
        token checks judged it (MetaCLIP 2's correct vision attention failed future_leakage). Such a model raises on
        its token ids, and `audit_model` audits it tower by tower, each tower on the example it declares (`_towers`).
        """
        self.T = T  # the tested sequence's length, for the token ids of another form
        main, inputs = self._declared_main(config, T, gen, device, dtype)
        required = [n for n, p in self.params.items() if p.default is p.empty and n != main and n not in self.fixed
                    and p.kind not in (p.VAR_KEYWORD, p.VAR_POSITIONAL)]
        if main == "pixel_values" and "spatial_shapes" in required:
            inputs = self._patches(config, gen, device, dtype)
            required = [n for n in required if n not in self.fixed]
        expect(not required, phrase("{example}... with every input the forward requires", self.options),
               f"{type(self.model).__name__}.forward requires {', '.join(map(repr, required))}, which nothing the "
               "model declares says how to build",
               phrase(f"pass {{example}}{{{main!r}: ..., {', '.join(f'{n!r}: ...' for n in required)}}}",
                      self.options))
        reached = self._trial(main, inputs, self.fixed)
        if reached is True:
            return main, inputs
        built, kept = (main, inputs), dict(self.fixed)
        for other, fixed in self._other_forms(config, main, inputs, gen, device, dtype):
            # where the model raises on every form, the one it ran furthest into its modules on is kept (a later one
            # on a tie) and model_runs says where it raised (inside an attention module: a finding, not the
            # example's fault): Swin raised in its third stage's attention on images, in its patch embedding on
            # pairs of them, which it does not take: the raise to report is the first
            tried = self._trial(other[0], other[1], fixed)
            if tried is True or tried >= reached:
                built, kept, reached = other, fixed, tried
            if tried is True:
                self.chosen = (f"{other[0]} {tuple(other[1].shape)}" + "".join(
                    f" with {n} {tuple(v.shape)}" for n, v in fixed.items() if isinstance(v, Tensor))
                    + f": the model raised on {main} {tuple(inputs.shape)}" + ("" if self.size_declared else
                                                                               ", a size nothing declares")
                    + "; pass example={...} to audit another")
                break
        self.fixed = kept
        return built

    def _trial(self, main: str, inputs: Tensor, fixed: dict) -> bool | int:
        """True where the model runs a forward of the example's first row (a trial under the state guard), else how
        many of its modules' forwards returned before it raised (how far into the model this form got)."""
        kwargs = {n: (v[:1] if isinstance(v, Tensor) and v.dim() >= 1 else v) for n, v in fixed.items()}
        returned = [0]

        def count(*_):
            returned[0] += 1

        handles = [m.register_forward_hook(count) for m in self.model.modules()]
        try:
            with untouched(self.model, inputs.device):
                self.model(**kwargs, **{main: inputs[:1]})
        except Exception:  # the user's model raised on this form: the caller tries another
            return returned[0]
        finally:
            for h in handles:
                h.remove()
        return True

    def _other_forms(self, config, main: str, inputs: Tensor, gen, device, dtype):
        """((main, inputs), fixed) the forward declares beside the built example, in the order tried: a pair of images
        (a keypoint matcher's (B, 2, C, H, W)); a video of the frames a config declares (`num_frames`: VideoMAE's 16,
        ViViT's 32, whose position tables are sized by them); larger images where no size was declared (64 px is
        the audit's guess: a detector whose 300 queries take the top 300 of its encoder's 84 tokens at 64 px, a
        feature pyramid whose last level is 1 x 1, refuse it); and, where the model takes token ids beside a signal,
        ids sized by the (decoder's) vocabulary: an encoder-decoder's decoder ids with the signal as its encoder's
        input (a vision or speech encoder-decoder's decoder reads text), else ids alone (Kosmos-2 declares pixels
        first and raises without ids)."""
        if main == "pixel_values" and inputs.dim() == 4:
            yield (main, torch.stack([inputs, inputs.roll(1, dims=0)], dim=1)), dict(self.fixed)  # (B, 2, C, H, W)
            frames = next((c.num_frames for c in sub_configs(config) if isinstance(getattr(c, "num_frames", None), int)
                           and not isinstance(c.num_frames, bool) and c.num_frames > 2), None)
            if frames:
                video = torch.randn(inputs.shape[0], frames, *inputs.shape[1:], generator=gen)  # (B, F, C, H, W)
                yield (main, video.to(device, dtype)), dict(self.fixed)
            if not self.size_declared:
                for size in LARGER_IMAGE_SIZES:
                    images = torch.randn(inputs.shape[0], inputs.shape[1], size, size, generator=gen)
                    yield (main, images.to(device, dtype)), dict(self.fixed)
        if main not in SIGNAL_NAMES:
            return
        text = config.get_text_config(decoder=True) if hasattr(config, "get_text_config") else config
        if self.encoder_decoder and self.takes("decoder_input_ids"):
            decoder = getattr(self.model, "decoder", None)
            vocab = declared_vocab(decoder, getattr(decoder, "config", text)) if isinstance(decoder, nn.Module) \
                else declared_vocab(self.model, text)
            if vocab:
                self.vocab, self.special = vocab, special_ids(config)
                yield ("decoder_input_ids", self.draw_ids((inputs.shape[0], self.T), gen).to(device)), \
                    {**self.fixed, main: inputs}
        elif self.takes("input_ids"):
            vocab = declared_vocab(self.model, text)
            if vocab:
                self.vocab, self.special = vocab, special_ids(config)
                yield ("input_ids", self.draw_ids((inputs.shape[0], self.T), gen).to(device)), dict(self.fixed)

    def _pixels(self, config, gen, device, dtype) -> Tensor | None:
        """Images (2, C, H, W) of the size a config or a config inside it declares; None if none does."""
        holder = next((c for c in sub_configs(config) if getattr(c, "image_size", None) is not None), None)
        if holder is None:
            return None
        size = holder.image_size
        h, w = (size, size) if isinstance(size, int) else tuple(size)[-2:]
        channels = getattr(holder, "num_channels", getattr(config, "num_channels", 3))
        return torch.randn(2, channels, h, w, generator=gen).to(device, dtype)

    def _patches(self, config, gen, device, dtype) -> Tensor:
        """Pixels as patches (2, N, C * p * p) on the grid closest to square of the config's `num_patches` N, with
        their `spatial_shapes` (2, 2) and a `pixel_attention_mask` (2, N) of ones, in fixed; a usage error where
        no config declares num_patches and patch_size."""
        holder = next((c for c in sub_configs(config) if isinstance(getattr(c, "num_patches", None), int)
                       and isinstance(getattr(c, "patch_size", None), int)), None)
        expect(holder is not None, phrase("{example}... with pixels as patches and their spatial_shapes",
                                          self.options),
               f"{type(self.model).__name__}, which takes spatial_shapes, with no num_patches and patch_size in its "
               "config", phrase("pass {example}{'pixel_values': (B, N, C*p*p), 'spatial_shapes': (B, 2), "
                                "'pixel_attention_mask': (B, N)}", self.options))
        n, p = holder.num_patches, holder.patch_size
        h = max(d for d in range(1, int(n ** 0.5) + 1) if n % d == 0)
        self.fixed["spatial_shapes"] = torch.tensor([[h, n // h]] * 2, device=device)
        if self.takes("pixel_attention_mask"):
            self.fixed["pixel_attention_mask"] = torch.ones(2, n, dtype=torch.long, device=device)
        channels = getattr(holder, "num_channels", 3)
        return torch.randn(2, n, channels * p * p, generator=gen).to(device, dtype)

    def _declared_main(self, config, T: int, gen, device, dtype):
        """The example a Hugging Face model declares it takes: its `main_input_name` (the forward's first input
        where that name is not one of them), token ids sized by the text config's vocabulary or the input embedding,
        with no special token among them, or pixels sized by the image size of the config or a config inside it;
        else a usage error that asks for one."""
        model = self.model
        main = getattr(model, "main_input_name", "input_ids")
        named = [n for n, p in self.params.items() if p.kind not in (p.VAR_KEYWORD, p.VAR_POSITIONAL)]
        if main not in named and named:  # a class that inherits the default "input_ids" yet takes pixels first
            main = named[0]
        text = config.get_text_config() if hasattr(config, "get_text_config") else config
        if main in ("input_ids", "decoder_input_ids"):
            vocab = declared_vocab(model, text)
            if vocab:
                self.vocab, self.special = vocab, special_ids(config)
                ids = self.draw_ids((2, T), gen).to(device)
                if self.encoder_decoder and self.takes("decoder_input_ids"):
                    # the encoder's ids from the encoder's own vocabulary where it declares one (Dia's: 256 text
                    # bytes, its decoder's 1028 audio codes; drawn from the decoder's, they were out of range)
                    encoder = model.get_encoder() if callable(getattr(model, "get_encoder", None)) else None
                    own = declared_vocab(encoder, getattr(encoder, "config", None)) if isinstance(
                        encoder, nn.Module) and encoder is not model else None
                    self.fixed["input_ids"] = self.draw_ids((2, T), gen, vocab=own or vocab).to(device)
                    return "decoder_input_ids", ids
                return "input_ids", ids
        if main == "pixel_values":
            pixels = self._pixels(config, gen, device, dtype)
            if pixels is not None:
                return "pixel_values", pixels
            # no size declared: a convolutional backbone or a detector takes any; the note says which was chosen
            channels = next((c.num_channels for c in sub_configs(config) if isinstance(getattr(c, "num_channels", None),
                                                                                       int)), 3)
            self.size_declared = False
            self.chosen = (f"pixel_values of {DEFAULT_IMAGE_SIZE} x {DEFAULT_IMAGE_SIZE}: the config declares no image "
                           f"size; pass example={{'pixel_values': ...}} at the size the model is used at")
            return "pixel_values", torch.randn(2, channels, DEFAULT_IMAGE_SIZE, DEFAULT_IMAGE_SIZE,
                                               generator=gen).to(device, dtype)
        if main in ("input_values", "input_features"):
            signal = self._signal(main, config, gen)
            if signal is not None:
                return main, signal.to(device, dtype)
        expect(False, phrase("{example}...: nothing the model declares says what it takes", self.options),
               f"{type(model).__name__}, whose main input is {main!r}, with no vocabulary (for token ids) or image "
               "size (for pixels) read from its config", phrase(f"pass {{example}}{{{main!r}: ...}}, a dict of the model's inputs",
                                         self.options))

    def _signal(self, main: str, config, gen) -> Tensor | None:
        """A speech model's input from its config: `input_values`, a waveform (B, samples), or a spectrogram (B,
        frames, bins) where the config declares its bins and a length (AST's max_length); `input_features`, (B, bins,
        frames), (B, frames, bins) or (B, 1, frames, bins) (a spectrogram as an image of one channel: CLAP's audio
        tower), bins from `FEATURE_SIZE_NAMES`, frames twice the encoder's positions where it declares them (Whisper's
        3,000 for 1,500), else 64. The layout is the first the model runs a plain forward
        on (which axis holds the bins is not declared); None if it runs on none."""
        found = sub_configs(config)
        read = lambda *names: next((getattr(c, n) for c in found for n in names  # noqa: E731
                                    if isinstance(getattr(c, n, None), int) and getattr(c, n) > 0), None)
        bins = read(*FEATURE_SIZE_NAMES)
        if main == "input_values":
            frames = read("max_length")
            candidates = [torch.randn(2, frames, bins, generator=gen)] if bins and frames else []
            candidates.append(torch.randn(2, read("n_samples", "chunk_length_samples") or DEFAULT_SAMPLES,
                                          generator=gen))
            candidates.append(torch.randn(2, 1, DEFAULT_SAMPLES, generator=gen))  # (B, channels, samples): codecs
        else:
            if not bins:
                return None
            positions = read("max_source_positions")
            frames = 2 * positions if positions else 64
            candidates = [torch.randn(2, bins, frames, generator=gen), torch.randn(2, frames, bins, generator=gen),
                          torch.randn(2, 1, frames, bins, generator=gen)]  # one channel: CLAP's audio tower
        for x in candidates:
            try:
                with torch.no_grad():
                    self.model(**{main: x[:1].to(*device_dtype(self.model))})
            except Exception:  # not this layout
                continue
            self.chosen = (f"{main} {tuple(x.shape)} read from the config; pass example={{{main!r}: ...}} to audit "
                           f"another")
            return x
        return None

    def draw_ids(self, shape, gen: torch.Generator, *, vocab: int | None = None) -> Tensor:
        """Token ids of `shape` drawn from the vocabulary (the main input's, or `vocab`) without its special ids
        (padding, begin, end, image, ...: a model may treat them apart, cutting lengths or moving positions)."""
        allowed = self.allowed_ids(vocab)
        return allowed[torch.randint(len(allowed), shape, generator=gen)]

    def allowed_ids(self, vocab: int | None = None) -> Tensor:
        keep = torch.ones(max(vocab or self.vocab, 1), dtype=torch.bool)
        special = [i for i in self.special if 0 <= i < len(keep)]
        if len(special) < len(keep):
            keep[special] = False
        return keep.nonzero().flatten()

    def __call__(self, seq: Tensor, *, attention_mask: Tensor | None = None, position_ids: Tensor | None = None,
                 past=None, use_cache: bool | None = None, grad: bool = False, model: nn.Module | None = None,
                 extra: dict | None = None):
        """(output tensor, cache or None). `attention_mask` (B, T) 1 = real token, in the model's spelling. `extra`:
        inputs of the model's own names the audit does not pass otherwise (`optional_masks`)."""
        model = model or self.model
        kwargs = dict(extra or {})
        for name, value in self.fixed.items():
            if name in kwargs:  # a fixed input the call gives itself (an encoder-decoder's encoder ids, padded)
                continue
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
                                                                                            dtype=float_dtype(model))
        if self.takes("use_cache") or self.takes_kwargs and self.hf and self.kwargs_take_cache:
            kwargs["use_cache"] = bool(use_cache)
        if past is not None:
            kwargs[self.cache_name] = past
        if isinstance(model, nn.TransformerDecoder) or isinstance(model, nn.TransformerEncoder):
            kwargs = {k: (v.to(float_dtype(model)) if isinstance(v, Tensor) and v.is_floating_point() and
                          k not in ("src_key_padding_mask", "tgt_key_padding_mask") else v) for k, v in kwargs.items()}
        elif seq.is_floating_point():
            kwargs[self.main] = seq.to(float_dtype(model))
        self.forwards += 1
        ctx = torch.enable_grad() if grad else torch.no_grad()
        with ctx:
            try:
                result = model(**kwargs)
            except TypeError as exc:
                # use_cache through **kwargs, which the forward does not name: a model that hands its **kwargs on to
                # a module that takes no use_cache (CLAP's audio encoder) or names it itself (Mimi's encoder passes
                # use_cache= and **kwargs to its transformer: "got multiple values") refuses it; use_cache=False
                # asks for nothing the model does not do without it, so it is left out from then on
                if use_cache or self.takes("use_cache") or "use_cache" not in kwargs or "'use_cache'" not in str(exc):
                    raise
                self.kwargs_take_cache = False
                del kwargs["use_cache"]
                result = model(**kwargs)
        out = first_tensor(result)
        if out is None:
            raise TypeError(f"the model returned {type(result).__name__} with no tensor in it")
        return out, (cache_of(result) if use_cache else None)

    def optional_masks(self) -> list[str]:
        """The masks the model's forward takes that the audit passes none of (left at their default None), other than
        its padding and head masks: a mask that turns on another path (Longformer's and LED's
        global_attention_mask, which selects the tokens attended by every other through their own projections); and
        its segment ids (`token_type_ids`), which turn on a path of their own where a model reads them only when given
        (XLNet's segment embeddings and bias in every attention layer). Each is tried as all ones, token by token."""
        passed = {self.main, self.padding_name, self.causal_mask_name, *self.fixed, *self.dropped}
        return [n for n, p in self.params.items() if (n.endswith("mask") or n.endswith("type_ids"))
                and p.default is None and n not in passed
                and "head_mask" not in n and n not in ("attention_mask", "decoder_attention_mask")]

    def optional_ids(self) -> list[list[str]]:
        """The optional token ids of a second stream the model's forward takes and the audit passes none of, each with
        the optional inputs of the same prefix that go with it ([`entity_ids`, `entity_attention_mask`,
        `entity_position_ids`, ...]): a stream that turns on a path of its own (LUKE's entity-aware query projections,
        used only with entities; Evolla's protein adapters, only with `protein_input_ids` and
        `protein_attention_mask`). Each group is tried as all ones, token by token. Not positions, segments (
        `optional_masks`) or a decoder's inputs."""
        passed = {self.main, self.padding_name, self.causal_mask_name, *self.fixed, *self.dropped}
        optional = [n for n, p in self.params.items() if p.default is None and n not in passed
                    and p.kind not in (p.VAR_KEYWORD, p.VAR_POSITIONAL)]
        groups = []
        for name in optional:
            if not name.endswith("_ids") or name.endswith(("position_ids", "type_ids")) or \
                    name.startswith("decoder_") or name == "input_ids":
                continue
            prefix = name.removesuffix("input_ids").removesuffix("ids")
            if not prefix.strip("_"):
                continue
            companions = [n for n in optional if n != name and n.startswith(prefix)
                          and n.endswith(("mask", "position_ids", "type_ids")) and "head_mask" not in n]
            groups.append([name, *companions])
        return groups

    def other_tokens(self, seq: Tensor, gen: torch.Generator) -> Tensor:
        """Every position changed: another token (ids), or a fresh draw pushed 1000x (embeddings)."""
        if self.tokens:
            allowed = self.allowed_ids()
            n = len(allowed)
            index = torch.full((max(self.vocab, int(seq.max()) + 1),), -1, dtype=torch.long)
            index[allowed] = torch.arange(n)
            shift = torch.randint(1, max(n, 2), seq.shape, generator=gen)
            return allowed[(index[seq.cpu()] + shift) % n].to(seq.device)  # another allowed id at every position
        return torch.randn(seq.shape, generator=gen, dtype=torch.float32).to(seq.device, seq.dtype) * 1000


def sub_configs(config) -> list:
    """A Hugging Face config and the configs inside it (text, vision, backbone, ...), outermost first."""
    found, todo = [], [config]
    while todo:
        c = todo.pop(0)
        if c is None or any(c is f for f in found):
            continue
        found.append(c)
        todo.extend(v for v in vars(c).values() if hasattr(v, "to_dict") and hasattr(v, "model_type"))
    return found


def declared_vocab(model: nn.Module, config) -> int | None:
    """The token ids a model's input takes: its config's `vocab_size`, no more than its input table's rows
    (`get_input_embeddings`, else its first nn.Embedding); None where neither says."""
    vocab = getattr(config, "vocab_size", None) if config is not None else None
    try:
        emb = model.get_input_embeddings()
    except NotImplementedError:  # transformers raises for a class that has no one table
        emb = None
    except AttributeError:  # not a PreTrainedModel: its first token table, as for a plain model
        emb = next((m for m in model.modules() if isinstance(m, nn.Embedding)), None)
    if not (isinstance(vocab, int) and vocab > 0) and isinstance(emb, nn.Embedding):
        vocab = emb.num_embeddings
    if isinstance(emb, nn.Embedding) and isinstance(vocab, int):
        vocab = min(vocab, emb.num_embeddings)
    return vocab if isinstance(vocab, int) and vocab > 0 else None


def special_ids(config) -> frozenset:
    """The special token ids a config and its sub-configs name (`*_token_id`, `*_token_index`, `*_token_ids`)."""
    found = set()
    for c in sub_configs(config):
        for name, value in vars(c).items():
            if name.endswith(("_id", "_index", "_ids")) and "token" in name:
                for v in (value if isinstance(value, (list, tuple)) else (value,)):
                    if isinstance(v, int) and not isinstance(v, bool) and v >= 0:
                        found.add(v)
    return frozenset(found)


def float_dtype(model: nn.Module) -> torch.dtype:
    """The floating dtype most of the model's parameters have."""
    return device_dtype(model)[1]


def device_dtype(model: nn.Module):
    """(device, dtype) of most of the model's floating parameters (by element count); CPU float32 if none."""
    counts: dict = {}
    for p in model.parameters():
        if p.is_floating_point():
            counts[(p.device, p.dtype)] = counts.get((p.device, p.dtype), 0) + p.numel()
    if not counts:
        return torch.device("cpu"), torch.float32
    return max(counts, key=counts.get)


def pad_tokens(runner: Runner, shape, gen) -> Tensor:
    """Tokens (or embeddings) of `shape` to pad a sequence with, drawn from `gen`."""
    if runner.tokens:
        return runner.draw_ids(shape, gen).to(runner.inputs.device)
    return torch.randn(shape, generator=gen).to(runner.inputs.device, runner.inputs.dtype)


__all__ = ["ALIGNED_NAMES", "MAIN_INPUT_NAMES", "Runner", "SIGNAL_NAMES", "cache_of", "device_dtype", "first_tensor", "float_dtype",
           "is_hf", "model_context", "output_tensors", "pad_tokens", "special_ids", "sub_configs"]
