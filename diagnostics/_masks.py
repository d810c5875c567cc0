"""Mask conventions: what a layer's mask means and what shape it has, said once, converted in one place.

The audit builds every mask in one internal form, bool (B, Tq, Tk), True = may attend. A layer takes its mask
in a *convention*: a meaning and a shape, the two independent.

    meaning   allowed   bool, True = may attend (torch SDPA, timm)
              blocked   bool, True = blocked (nn.MultiheadAttention, key_padding_mask)
              additive  float, 0 where attending is allowed, a large negative number where blocked
    shape     B,1,Tq,Tk   one mask per batch row, broadcast over heads (the default)
              B,Tq,Tk     the same without the head axis (`baddbmm`-style processors)
              B*H,Tq,Tk   one per batch row and head, heads folded into the batch (nn.MultiheadAttention)
              Tq,Tk       one for the whole batch (a causal buffer): rows that differ reach the layer one at a time
              B,Tk        one per key (padding): masks that differ between queries reach it one query at a time
              Tq,Tk,B     a sequence-first layer's (layout="tbd"): queries, keys, then the batch (labml-nn's)

`MaskConvention(meaning, shape)` is the public spelling; so is a string: a shortcut (`allowed`, `blocked`,
`additive`, `key_padding` = blocked:B,Tk, `key_keep` = allowed:B,Tk, `mha_blocked` = blocked:B*H,Tq,Tk) or
`MEANING:SHAPE` (`additive:B,Tq,Tk`). `mask_convention()` parses all of them, for audit(), the command line
and the pytest plugin alike, and `convert_mask()` is the one conversion.

Ground floor: torch and the error type only.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import torch
from torch import Tensor

from ._errors import AuditUsageError

MEANINGS = {
    "allowed": "bool, True = may attend",
    "blocked": "bool, True = blocked",
    "additive": "float, 0 where attending is allowed and a large negative number where blocked",
}
SHAPES = {
    "B,1,Tq,Tk": "(B, 1, Tq, Tk)",
    "B,Tq,Tk": "(B, Tq, Tk)",
    "B*H,Tq,Tk": "(B*H, Tq, Tk), heads folded into the batch",
    "Tq,Tk": "(Tq, Tk), one for the whole batch",
    "B,Tk": "(B, Tk), one per key",
    "Tq,Tk,B": "(Tq, Tk, B), the batch last (a sequence-first layer's)",
}
DEFAULT_SHAPE = "B,1,Tq,Tk"


@dataclass(frozen=True)
class MaskConvention:
    """How a layer takes its mask: `meaning` (MEANINGS) and `shape` (SHAPES).

        MaskConvention("additive", "B,Tq,Tk")      # str(): "additive:B,Tq,Tk"
        MaskConvention("blocked", "B,Tk")          # str(): "key_padding", its shortcut
    """

    meaning: str = "allowed"
    shape: str = DEFAULT_SHAPE

    def __post_init__(self):
        if self.meaning not in MEANINGS or self.shape not in SHAPES:
            raise AuditUsageError(f"expected a MaskConvention with meaning in {', '.join(MEANINGS)} and shape in "
                                  f"{', '.join(SHAPES)}; got MaskConvention({self.meaning!r}, {self.shape!r}). "
                                  f"Fix: {ACCEPTED_FIX}")

    def __str__(self) -> str:
        for name, convention in SHORTCUTS.items():
            if convention == self:
                return name
        return f"{self.meaning}:{self.shape}"

    def describe(self) -> str:
        """In words, e.g. 'float (B, Tq, Tk), 0 where attending is allowed and ...'."""
        kind, _, rest = MEANINGS[self.meaning].partition(", ")
        return f"{kind} {SHAPES[self.shape]}, {rest}"

    @property
    def per_key(self) -> bool:
        """One mask row for every query (B, Tk): a mask that differs between queries cannot be given at once."""
        return self.shape == "B,Tk"

    @property
    def per_batch(self) -> bool:
        """One mask for every batch row (Tq, Tk)."""
        return self.shape == "Tq,Tk"


SHORTCUTS = {
    "allowed": MaskConvention("allowed"),
    "blocked": MaskConvention("blocked"),
    "additive": MaskConvention("additive"),
    "key_padding": MaskConvention("blocked", "B,Tk"),
    "key_keep": MaskConvention("allowed", "B,Tk"),
    "mha_blocked": MaskConvention("blocked", "B*H,Tq,Tk"),
}
DECLARABLE = ("allowed", "blocked", "additive", "key_padding", "key_keep")  # the shortcuts a user declares
ACCEPTED = (f"the shortcuts {', '.join(SHORTCUTS)}, or MEANING:SHAPE with MEANING in {', '.join(MEANINGS)} and "
            f"SHAPE in {', '.join(SHAPES)}")
ACCEPTED_FIX = ('e.g. "additive:B,Tq,Tk" (float, 0 keep / large negative block, no head axis), "key_keep" ((B, Tk) '
                'bool, True = keep) or MaskConvention("blocked", "B*H,Tq,Tk")')


def mask_convention(spec, *, spelled: str = "mask=") -> MaskConvention:
    """A `MaskConvention` from what a user wrote: a MaskConvention, a shortcut or `MEANING:SHAPE` (spaces and
    parentheses ignored: `additive:(B, Tq, Tk)`). `spelled`: the option as the front end names it (`mask=`,
    `--mask`; "" for none), for the message of the `AuditUsageError` raised on anything else."""
    if isinstance(spec, MaskConvention):
        return spec
    if isinstance(spec, str):
        text = re.sub(r"[\s()]", "", spec)
        if text.lower() in SHORTCUTS:
            return SHORTCUTS[text.lower()]
        meaning, sep, shape = text.partition(":")
        shape = next((s for s in SHAPES if s.lower() == shape.lower()), None)
        if sep and meaning.lower() in MEANINGS and shape is not None:
            return MaskConvention(meaning.lower(), shape)
    shown = f"{spelled}{spec!r}" if not spelled or spelled.endswith("=") else f"{spelled} {spec}"
    raise AuditUsageError(f"expected a mask convention from {ACCEPTED}; got {shown}. Fix: {ACCEPTED_FIX}")


def expressible(allowed: Tensor, convention: MaskConvention) -> bool:
    """Whether `allowed` (B, Tq, Tk) can be given in `convention` at once: a (B, Tk) mask holds one row for every
    query, a (Tq, Tk) one the same mask for every batch row."""
    if convention.per_key:
        return bool((allowed == allowed[:, :1, :]).all())
    if convention.per_batch:
        return bool((allowed == allowed[:1]).all())
    return True


def convert_mask(allowed: Tensor, convention, *, dtype: torch.dtype = torch.float32, num_heads: int = 1) -> Tensor:
    """Our mask, bool (B, 1, Tq, Tk) or (B, Tq, Tk), True = may attend, in `convention` (a MaskConvention or its
    spelling): the meaning (allowed as is; blocked inverted; additive as `dtype`, 0 allowed and
    torch.finfo(dtype).min blocked, a finite fill, so that a fully blocked row gives uniform weights, not NaN, as
    Hugging Face's eager masks do) in the shape (heads repeated for B*H; the first query's row for (B, Tk); the
    first batch row for (Tq, Tk), which must then hold for every row: see `expressible`)."""
    convention = mask_convention(convention, spelled="")
    if allowed.dim() == 4 and convention == SHORTCUTS["allowed"]:
        return allowed  # the audit's own form, as it is
    allowed = allowed[:, 0] if allowed.dim() == 4 else allowed  # (B, Tq, Tk)
    if not expressible(allowed, convention):
        raise AuditUsageError(f"expected a mask {convention} can hold ({SHAPES[convention.shape]}); got one that "
                              f"differs between {'queries' if convention.per_key else 'batch rows'}. Fix: give such "
                              f"a layer one query (one batch row) at a time, as the audit does")
    shaped = {"B,1,Tq,Tk": lambda m: m.unsqueeze(1),  # (B, 1, Tq, Tk)
              "B,Tq,Tk": lambda m: m,
              "B*H,Tq,Tk": lambda m: m.repeat_interleave(num_heads, dim=0),  # (B*H, Tq, Tk)
              "Tq,Tk": lambda m: m[0],  # (Tq, Tk)
              "B,Tk": lambda m: m[:, 0, :],  # (B, Tk)
              "Tq,Tk,B": lambda m: m.permute(1, 2, 0)}[convention.shape](allowed)  # (Tq, Tk, B)
    if convention.meaning == "allowed":
        return shaped
    if convention.meaning == "blocked":
        return ~shaped
    return torch.zeros(shaped.shape, dtype=dtype, device=shaped.device).masked_fill(~shaped, torch.finfo(dtype).min)


# ---- what a layer says about its mask ------------------------------------------------------------------------

_TRUTH = r"(?:\btrue\b|\bones?\b|\b1\b|\bnon-?zero\b)"
_FALSITY = r"(?:\bfalse\b|\bzeros?\b|\b0\b)"
_TRUE_OF = re.compile(_TRUTH + r"(?:\s+(?:values?|entries|elements|positions?))?\s*(?:=|:|->|for\b|means\b|"
                      r"indicates?\b|marks?\b|where\b|at\b|if\b|denotes?\b|represents?\b|are\b|is\b)", re.I)
_FALSE_OF = re.compile(_FALSITY + r"(?:\s+(?:values?|entries|elements|positions?))?\s*(?:=|:|->|for\b|means\b|"
                       r"indicates?\b|marks?\b|where\b|at\b|if\b|denotes?\b|represents?\b|are\b|is\b)", re.I)
_NOT_ATTENDED = re.compile(r"not\s+(?:be\s+)?(?:allowed\s+to\s+)?attend|not\s+(?:be\s+)?allowed|cannot\s+attend|"
                           r"can't\s+attend|"
                           r"not\s+(?:be\s+)?attended|\bmasked\b(?!\s+(?:positions?\s+)?(?:are|is)\s+not)|"
                           r"\bmask(?:ed)?\s+out|\bto\s+mask\b|\bignor|\bblock|\bpad|\bexclud|\bprevent|\bdisallow|"
                           r"\bdrop", re.I)
_ATTENDED = re.compile(r"not\s+(?:be\s+)?masked|\bunmasked|not\s+pad|\battend(?!ion)|\bkeep|\bkept|\bvalid\b|"
                       r"\bvisible|\ballow|\breal\b|\binclude|\bused\b", re.I)
_ADDITIVE = re.compile(r"\badditive\b|added\s+to\s+the\s+(?:attention\s+)?(?:scores|logits|weights)|-\s*inf\b|"
                       r"large\s+negative|-1e\d|-10000\b|finfo", re.I)
_TUPLE = re.compile(r"[(\[]([^()\[\]]{1,80})[)\]]")
_BATCH_NAME = re.compile(r"^(?:b|n|bs|bsz|batch(?:[_ ]?size)?|num_batches)$", re.I)
_LAST_BATCH = re.compile(r"^(?:b|bs|bsz|batch(?:[_ ]?size)?|num_batches)$", re.I)  # not n: (1, n, n) is tokens
_TIME_NAME = re.compile(r"^(?:t|l|s|seq|seqlen|seq_?len(?:gth)?|sequence(?:_?length)?|len(?:gth)?|(?:tgt|src|q|k|kv|"
                        r"query|key)_?len(?:gth)?|time(?:steps?)?|steps?|n_?tokens|num_tokens|tokens?|n_ctx)$", re.I)
_TIMES = re.compile(r"\b(\w+)\s+[x×]\s+(\w+)\s+[x×]\s+(\w+)\b")  # fairseq's "Time x Batch x Channel"


def _clause(text: str, start: int) -> str:
    """The words about one truth value, from `start` up to the end of its clause."""
    end = re.search(r"[.;]\s|\n\s*\n|,\s*(?:and\s+|while\s+|whereas\s+)?(?:false|true|0|1)\b|\bwhile\b|\bwhereas\b",
                    text[start + 1:], re.I)
    return text[start:start + 1 + (end.start() if end else 160)]


def _meaning_of(words: str) -> str | None:
    """'blocked' or 'allowed': what the truth value these words describe does to attention."""
    if _ADDITIVE.search(words) and not re.search(r"\bbool", words, re.I):
        return None
    if re.search(r"not\s+(?:be\s+)?masked|\bunmasked", words, re.I):
        return "allowed"
    # the first word that says either decides: "True = keep (the decoder block's memory)" keeps; a later noun
    # ("block", "pad") describes something else
    blocked, allowed = _NOT_ATTENDED.search(words), _ATTENDED.search(words)
    if blocked and (allowed is None or blocked.start() < allowed.start()):
        return "blocked"
    return "allowed" if allowed else None


def _shape_of(words: str) -> str | None:
    """The first mask shape written as a tuple, e.g. '(batch, src_len)' -> 'B,Tk'."""
    for found in _TUPLE.finditer(words):
        dims = [d.strip() for d in found.group(1).split(",")]
        names = [d for d in dims if d != "1"]  # (B, 1, Tq, Tk): a broadcast axis
        if len(dims) < 2 or not all(re.fullmatch(r"[A-Za-z_][\w* ]{0,29}", d) for d in names):
            continue  # not a shape: "[0, 1]", "(i.e. ...)"
        if len(dims) == 4:
            return "B,1,Tq,Tk"
        if len(dims) == 3:
            if _TIME_NAME.match(dims[0]) and _TIME_NAME.match(dims[1]) and _LAST_BATCH.match(dims[2]):
                return "Tq,Tk,B"  # [seq_len, seq_len, batch_size]: a sequence-first layer's
            return "B*H,Tq,Tk" if "*" in dims[0] or "head" in dims[0].lower() else "B,Tq,Tk"
        if len(dims) == 2:
            return "B,Tk" if _BATCH_NAME.match(dims[0]) else "Tq,Tk"
    return None


def stated_in_text(text: str | None, name: str) -> tuple[MaskConvention, str] | None:
    """The convention a docstring states for the mask parameter `name`, and the words that state it; None when it
    states none. Read from the text about `name` (its entry in an Args list, or the sentence that names it):
    what True (or 1, or False) means ("True for positions to mask", "True = may attend", "1 for tokens that are
    not masked"), whether it is additive ("added to the attention scores", "-inf"), and its shape where written
    as a tuple ("(batch, src_len)")."""
    if not text:
        return None
    at = re.search(rf"(?<![\w.]){re.escape(name)}\b", text)
    if at is None:
        return None
    rest = text[at.start():]
    line_start = text.rfind("\n", 0, at.start()) + 1
    if re.fullmatch(r"[\s`*-]*", text[line_start:at.start()]):
        # an entry of an Args list: up to the next entry ("    other_name (...):" / "other_name:") or blank line
        stop = re.search(r"\n\s*\n|\n\s*(?!" + re.escape(name) + r"\b)\w+\s*(?:\([^)]*\))?\s*:", rest)
    else:  # prose: the sentence that names it
        stop = re.search(r"\.\s|\n\s*\n", rest)
    entry = rest[:stop.start() if stop else 600]
    shape = _shape_of(entry)
    if _ADDITIVE.search(entry) and not re.search(r"\bbool", entry, re.I):
        quote = _ADDITIVE.search(entry).group(0)
        return MaskConvention("additive", shape or DEFAULT_SHAPE), f"its docstring says {quote!r}"
    meanings = set()
    quote = ""
    for pattern, flip in ((_TRUE_OF, False), (_FALSE_OF, True)):
        for found in pattern.finditer(entry):
            words = _clause(entry, found.start())
            meaning = _meaning_of(words[len(found.group(0)):])
            if meaning is not None:
                meanings.add({"allowed": "blocked", "blocked": "allowed"}[meaning] if flip else meaning)
                quote = quote or " ".join(words.split()).rstrip(".,;:")
    if len(meanings) != 1:
        return None  # silent, or contradicting itself
    meaning = meanings.pop()
    if shape is None and re.search(r"key[_ ]padding|padding\s+mask", entry, re.I):
        shape = "B,Tk"
    return MaskConvention(meaning, shape or DEFAULT_SHAPE), f"its docstring says {quote!r}"



_OTHER_TENSOR = re.compile(r"\b(?:cache|table|weights?|bias|mask|outputs?|returns?|buffer|memory|embeddings? table)\b",
                           re.I)


def _own_sentences(entry: str, name: str) -> str:
    """The sentences of an entry about its own input: from the first, up to one that names another tensor (a name in
    backticks the first did not name, or a cache, table, weights, bias, mask, output: "The table `pos` is kept as
    (seq_len, batch, d_model)")."""
    sentences = re.split(r"(?<=[.;])\s+", entry.strip())
    own = set(re.findall(r"`(\w+)`", sentences[0])) | {name}
    kept = [sentences[0]]
    for sentence in sentences[1:]:
        named = set(re.findall(r"`([A-Za-z_]\w*)`", sentence))
        if named - own or _OTHER_TENSOR.search(sentence):
            break
        kept.append(sentence)
    return " ".join(kept)


def stated_layout_in_text(text: str | None, name: str) -> tuple[str, str] | None:
    """("tbd" or "btd", the words) where a docstring gives the input `name` a shape of three named axes in its own
    entry: an entry that starts with the name (an Args list's `name: ...`, `:param name: ...`, labml-nn's "`query`, `key`
    and `value` are the tensors ... They have shape `[seq_len, batch_size, d_model]`") or with "Input shape:"
    (fairseq's, about every input), up to the next entry, a blank
    line or a Returns section. "tbd" for a time axis first and a batch axis second (torch's "(L, N, E)", fairseq's
    "Time x Batch x Channel"), "btd" for the batch first; None where the entry gives neither, both (torch's "(L, N, E)
    when batch_first=False or (N, L, E) when batch_first=True"), or there is no entry: a shape written for another
    tensor (a returned weight, a cache, a table) says nothing of the input's."""
    if not text:
        return None
    starts = re.compile(rf"^\s*(?:[-*]\s*)?(?::param\s+(?:\w+\s+)?)?[`*]*{re.escape(name)}[`*]*\s*"
                        rf"(?:[:(,]|\s(?:is|are|has|have|and)\b)|^\s*inputs?(?:\s+shapes?)?\s*:", re.I)
    other = re.compile(r"^\s*(?:[-*]\s*)?(?::\w+\s+(?:\w+\s+)?)?[`*]*\w+[`*]*\s*(?:\([^)]*\))?\s*:(?!\S)|"
                       r"^\s*(?:Returns?|Yields?|Outputs?|Raises|Examples?)\s*:?\s*$|^\s*:(?:returns?|rtype)\b", re.I)
    lines = text.split("\n")
    for i, line in enumerate(lines):
        if not starts.match(line):
            continue
        entry = [line]
        for following in lines[i + 1:]:
            if not following.strip() or other.match(following):
                break
            entry.append(following)
        words = _own_sentences("\n".join(entry), name)
        read = {}
        for found in [*_TUPLE.finditer(words), *_TIMES.finditer(words)]:
            dims = [d.strip(" `*") for d in (found.group(1).split(",") if found.re is _TUPLE else found.groups())]
            if len(dims) != 3 or not all(re.fullmatch(r"[A-Za-z_]\w{0,29}", d) for d in dims):
                continue
            if _TIME_NAME.match(dims[0]) and _BATCH_NAME.match(dims[1]) and not _BATCH_NAME.match(dims[0]):
                read.setdefault("tbd", found.group(0).strip())
            elif _BATCH_NAME.match(dims[0]) and _TIME_NAME.match(dims[1]) or _BATCH_NAME.match(dims[0]) and \
                    dims[1].lower() == "n":
                read.setdefault("btd", found.group(0).strip())
        if len(read) == 1:
            (layout, quote), = read.items()
            return layout, f"its docstring says {quote!r}"
        return None  # the entry gives no shape of the input, or gives both layouts
    return None


KNOWN_LAYERS: dict[tuple[str, str, str], MaskConvention] = {}
"""{(module prefix, class name, mask parameter): convention} for library classes whose mask convention is documented
but not stated in a form the docstring reader takes. torch's own layers and Hugging Face's are known by their own
code in `_subject`; add an entry here (with the library's documentation as a comment) rather than a branch."""


def known_convention(layer, name: str) -> MaskConvention | None:
    module, cls = type(layer).__module__, type(layer).__name__
    return next((c for (prefix, klass, param), c in KNOWN_LAYERS.items()
                 if module.startswith(prefix) and cls == klass and param == name), None)


__all__ = ["ACCEPTED", "DECLARABLE", "DEFAULT_SHAPE", "KNOWN_LAYERS", "MEANINGS", "SHAPES", "SHORTCUTS",
           "MaskConvention", "convert_mask", "expressible", "known_convention", "mask_convention", "stated_in_text",
           "stated_layout_in_text"]
