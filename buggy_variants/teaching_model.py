"""Tiny GPTs for the model audit, and the teaching report's model chapter.

`TinyGPT`: nanoGPT's model file in miniature, its attention the reference `correct.MultiHeadAttention(causal=True)`,
so that any catalog variant can be swapped into one layer (`inject(model, layer, variant)`).

`ProtocolGPT`: a decoder with the keyword protocol `diagnostics.audit_model` uses for plain models (Hugging Face's:
`forward(input_ids, attention_mask=None, position_ids=None, past_key_values=None, use_cache=False)`, returning
logits, or `(logits, cache)` with `use_cache=True`), learned or rotary positions, an optional sliding window, and
the model-level bugs of public reports, each switchable into one layer (`layer_bugs`) or into the model
(`model_bug`):

- `prefill_unmasked` (layer): with a cache attached, a prefill of several tokens skips the causal mask
  (TinyLLM #17, Qwen #979);
- `rotary_no_offset` (layer): rotary positions 0..Tq-1 for the new tokens, not offset by the cache length
  (executorch PR #2010);
- `window_off_by_one` (layer): the sliding window lets w + 1 keys in, not w (NeMo PR #9672, mlx-lm PR #390);
- `positions_ignore_padding` (model): position ids 0..T-1 whatever the attention mask, so left padding shifts
  every real token's position (unsloth #3699, nnsight PR #673).

The model chapter of the teaching report (`model_chapter_html`) audits a TinyGPT with one catalog bug in one layer.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from correct import MultiHeadAttention

LAYER_BUGS = ("prefill_unmasked", "rotary_no_offset", "window_off_by_one")
MODEL_BUGS = ("positions_ignore_padding",)


# ---- TinyGPT: the reference attention in nanoGPT's frame --------------------------------------------------


class MLP(nn.Module):
    def __init__(self, d_model: int):
        super().__init__()
        self.fc, self.proj = nn.Linear(d_model, 4 * d_model), nn.Linear(4 * d_model, d_model)

    def forward(self, x: Tensor) -> Tensor:
        return self.proj(F.gelu(self.fc(x)))


class Block(nn.Module):
    def __init__(self, d_model: int, num_heads: int):
        super().__init__()
        self.ln_1, self.ln_2 = nn.LayerNorm(d_model), nn.LayerNorm(d_model)
        self.attn = MultiHeadAttention(d_model, num_heads, causal=True)
        self.mlp = MLP(d_model)

    def forward(self, x: Tensor) -> Tensor:
        x = x + self.attn(self.ln_1(x))[0]  # (B, T, D); the reference returns (out, weights)
        return x + self.mlp(self.ln_2(x))


class TinyGPT(nn.Module):
    """Token and learned position embeddings, `n_layer` pre-norm blocks, a language-model head."""

    causal = True

    def __init__(self, vocab_size: int = 64, n_layer: int = 3, d_model: int = 32, num_heads: int = 4,
                 block_size: int = 32):
        super().__init__()
        self.block_size = block_size
        self.wte, self.wpe = nn.Embedding(vocab_size, d_model), nn.Embedding(block_size, d_model)
        self.h = nn.ModuleList(Block(d_model, num_heads) for _ in range(n_layer))
        self.ln_f, self.lm_head = nn.LayerNorm(d_model), nn.Linear(d_model, vocab_size, bias=False)

    def forward(self, input_ids: Tensor) -> Tensor:
        B, T = input_ids.shape  # batch, sequence length
        x = self.wte(input_ids) + self.wpe(torch.arange(T, device=input_ids.device))  # (B, T, D)
        for block in self.h:
            x = block(x)
        return self.lm_head(self.ln_f(x))  # (B, T, vocab)


def inject(model: TinyGPT, layer: int, variant, *, reference: bool = False) -> TinyGPT:
    """Swap the attention of block `layer` for the catalog variant's layer, with the same weights; with
    `reference=True`, for its correct twin (the reference configured like the variant, e.g. with rotary positions)."""
    old = model.h[layer].attn
    build = variant.reference if reference else variant.build
    new = build(old.d_model, old.num_heads, causal=True)
    new.load_state_dict(old.state_dict())
    model.h[layer].attn = new
    return model


# ---- ProtocolGPT: padding, positions, a cache and a sliding window -----------------------------------------


def rotate(x: Tensor, positions: Tensor) -> Tensor:
    """Rotary embedding of (B, H, T, d) at integer positions (B, T) (RoFormer; halves rotated)."""
    d = x.shape[-1]
    freq = 1.0 / (10000 ** (torch.arange(0, d, 2, device=x.device, dtype=torch.float32) / d))  # (d/2,)
    angle = positions.to(torch.float32).unsqueeze(-1) * freq  # (B, T, d/2)
    cos, sin = angle.cos().unsqueeze(1).to(x.dtype), angle.sin().unsqueeze(1).to(x.dtype)  # (B, 1, T, d/2)
    x1, x2 = x[..., : d // 2], x[..., d // 2:]
    return torch.cat([x1 * cos - x2 * sin, x1 * sin + x2 * cos], dim=-1)


class ProtocolAttention(nn.Module):
    """Causal self-attention over a cache: keys are the cached ones then the new ones; query i (absolute position
    past + i) may attend key j when j <= past + i, the key is not padding, and, with a window w, past + i - j < w."""

    def __init__(self, d_model: int, num_heads: int, *, rotary: bool, sliding_window: int | None, bug: str | None):
        super().__init__()
        self.d_model, self.num_heads, self.head_dim = d_model, num_heads, d_model // num_heads
        self.rotary, self.sliding_window, self.bug = rotary, sliding_window, bug
        self.qkv, self.out = nn.Linear(d_model, 3 * d_model), nn.Linear(d_model, d_model)

    def forward(self, x: Tensor, positions: Tensor, keep: Tensor, cache: list | None = None) -> Tensor:
        """x (B, Tq, D); positions (B, Tq); keep (B, Tk) 1 = a real key (the cache's and the new ones); cache: a
        list [k, v] for this layer (empty before the prefill), extended in place, or None."""
        B, T, D = x.shape  # batch, new tokens, d_model
        q, k, v = self.qkv(x).view(B, T, 3, self.num_heads, self.head_dim).permute(2, 0, 3, 1, 4)  # (B, H, T, d)
        if self.rotary:
            at = torch.arange(T, device=x.device).expand(B, T) if self.bug == "rotary_no_offset" else positions
            q, k = rotate(q, at), rotate(k, at)
        past = 0
        if cache is not None:
            if cache:
                past = cache[0].shape[2]
                k, v = torch.cat([cache[0], k], 2), torch.cat([cache[1], v], 2)  # (B, H, past + T, d)
            cache[:] = [k, v]
        Tk = k.shape[2]
        i = torch.arange(T, device=x.device).view(T, 1) + past  # absolute query positions
        j = torch.arange(Tk, device=x.device).view(1, Tk)
        allowed = j <= i  # (T, Tk)
        if self.bug == "prefill_unmasked" and cache is not None and past == 0 and T > 1:
            allowed = torch.ones_like(allowed)  # the bug: a prefill through the cache without its causal mask
        if self.sliding_window is not None:
            w = self.sliding_window + (1 if self.bug == "window_off_by_one" else 0)
            allowed = allowed & (i - j < w)
        allowed = allowed & keep.bool().view(B, 1, 1, Tk)  # (B, 1, T, Tk)
        scores = q @ k.transpose(-2, -1) / math.sqrt(self.head_dim)  # (B, H, T, Tk)
        # finfo.min, not -inf: a padding query with no real key gets uniform weights, not NaN
        scores = scores.masked_fill(~allowed, torch.finfo(scores.dtype).min)
        out = scores.softmax(-1) @ v  # (B, H, T, d)
        return self.out(out.transpose(1, 2).reshape(B, T, D))


class ProtocolBlock(nn.Module):
    def __init__(self, d_model: int, num_heads: int, **kw):
        super().__init__()
        self.ln_1, self.ln_2 = nn.LayerNorm(d_model), nn.LayerNorm(d_model)
        self.attn, self.mlp = ProtocolAttention(d_model, num_heads, **kw), MLP(d_model)

    def forward(self, x, positions, keep, cache=None):
        x = x + self.attn(self.ln_1(x), positions, keep, cache)
        return x + self.mlp(self.ln_2(x))


class ProtocolGPT(nn.Module):
    causal = True

    def __init__(self, vocab_size: int = 64, n_layer: int = 3, d_model: int = 32, num_heads: int = 4,
                 block_size: int = 32, *, rotary: bool = False, sliding_window: int | None = None,
                 layer_bugs: dict | None = None, model_bug: str | None = None):
        super().__init__()
        layer_bugs = layer_bugs or {}
        assert set(layer_bugs.values()) <= set(LAYER_BUGS) and model_bug in (None, *MODEL_BUGS)
        self.block_size, self.rotary, self.model_bug = block_size, rotary, model_bug
        self.wte = nn.Embedding(vocab_size, d_model)
        self.wpe = None if rotary else nn.Embedding(block_size, d_model)
        self.h = nn.ModuleList(ProtocolBlock(d_model, num_heads, rotary=rotary, sliding_window=sliding_window,
                                             bug=layer_bugs.get(n)) for n in range(n_layer))
        self.ln_f, self.lm_head = nn.LayerNorm(d_model), nn.Linear(d_model, vocab_size, bias=False)

    def forward(self, input_ids: Tensor, attention_mask: Tensor | None = None, position_ids: Tensor | None = None,
                past_key_values: list | None = None, use_cache: bool = False):
        B, T = input_ids.shape  # batch, new tokens
        past = past_key_values[0][0].shape[2] if past_key_values and past_key_values[0] else 0
        if attention_mask is None:
            attention_mask = torch.ones(B, past + T, dtype=torch.long, device=input_ids.device)
        elif attention_mask.shape[1] == T and past:
            attention_mask = torch.cat([torch.ones(B, past, dtype=attention_mask.dtype, device=input_ids.device),
                                        attention_mask], 1)
        if position_ids is None or self.model_bug == "positions_ignore_padding":
            position_ids = (past + torch.arange(T, device=input_ids.device)).expand(B, T)
        x = self.wte(input_ids)  # (B, T, D)
        if self.wpe is not None:
            x = x + self.wpe(position_ids)
        cache = (past_key_values or [[] for _ in self.h]) if use_cache else None
        for n, block in enumerate(self.h):
            x = block(x, position_ids, attention_mask, None if cache is None else cache[n])
        logits = self.lm_head(self.ln_f(x))  # (B, T, vocab)
        return (logits, cache) if use_cache else logits


# ---- the teaching report's model chapter -----------------------------------------------------------------------

CHAPTER_BUG = ("missing_causal_mask", 1)  # the catalog variant, and the block whose attention it replaces


def chapter_reports(variants: dict) -> dict:
    """The audits the chapter shows: TinyGPT clean and with the chapter's bug in one layer; ProtocolGPT (rotary)
    clean and with its rotary positions not offset by the cache in one layer."""
    import diagnostics

    vid, layer = CHAPTER_BUG
    torch.manual_seed(0)
    clean = TinyGPT()
    torch.manual_seed(0)
    broken = inject(TinyGPT(), layer, variants[vid])
    torch.manual_seed(0)
    cache_clean = ProtocolGPT(rotary=True)
    torch.manual_seed(0)
    cache_broken = ProtocolGPT(rotary=True, layer_bugs={layer: "rotary_no_offset"})
    return {name: diagnostics.audit_model(model) for name, model in
            (("clean", clean), ("broken", broken), ("cache_clean", cache_clean), ("cache_broken", cache_broken))}


def reach_svg(readings: dict, *, label: str) -> str:
    """A bar per layer: how many past positions (<= the cut) a change after the cut reaches in that layer's output."""
    reach, positions = readings["reach"], readings["positions"]
    width, bar, gap, height = 360, 22, 8, 120
    rows = []
    for n, (path, moved) in enumerate(reach.items()):
        y = 10 + n * (bar + gap)
        w = 0 if not positions else (width - 160) * moved / positions
        colour = "#d73a49" if moved else "#4d7a4d"
        rows.append(f'<text x="0" y="{y + 15}" font-size="12" font-family="monospace">{path}</text>'
                    f'<rect x="110" y="{y}" width="{max(w, 1):.1f}" height="{bar}" fill="{colour}"/>'
                    f'<text x="{116 + w:.1f}" y="{y + 15}" font-size="12">{moved} / {positions}</text>')
    height = 10 + len(reach) * (bar + gap)
    return (f'<svg xmlns="http://www.w3.org/2000/svg" role="img" aria-label="{label}" width="{width}" '
            f'height="{height}" viewBox="0 0 {width} {height}">{"".join(rows)}</svg>')


def wide_table(header, rows) -> str:
    """A table in the report's one style (the shared `results` table, `compact`: as wide as its content), in its
    own box that scrolls sideways when the window is narrower. `header`: the column titles; `rows`: each a
    sequence of cells, already HTML."""
    head = "".join(f"<th>{h}</th>" for h in header)
    body = "".join("<tr>" + "".join(f"<td>{cell}</td>" for cell in row) + "</tr>" for row in rows)
    return (f'<div class="wide"><table class="results compact"><thead><tr>{head}</tr></thead><tbody>{body}</tbody>'
            f"</table></div>")


def _badge(verdict: str, text: str = "") -> str:
    """The shared verdict badge (diagnostics' `verdict_badge`: the same classes, so the same look), reading `text`
    (the verdict itself by default)."""
    return f'<span class="verdict v-{verdict}">{text or verdict}</span>'


# A plain model's cache skip reads "see the module docstring for plain models": a reader of the report has no
# docstring at hand, so the chapter says what that docstring says.
_DOCSTRING_POINTER = "see the module docstring for plain models"
_PROTOCOL = ("a plain model takes part when its forward accepts (input_ids, attention_mask=None, position_ids=None, "
             "past_key_values=None, use_cache=False) and returns (logits, cache) with use_cache=True")


_STATUS_BADGE = {"passed": "pass", "failed": "fail"}  # an inconclusive layer measured too little: grey, as a skip


def _layer_table(report) -> str:
    from diagnostics._html import escape

    layers = wide_table(("layer (audited in place)", "status", "detectors that fired"), [
        (f"<code>{escape(p)}</code>", _badge(_STATUS_BADGE.get(rep.status, "skip"), escape(rep.status)),
         escape(", ".join(r.detector for r in rep.results if r.fired) or "-"))
        for p, rep in report.layers.items()])
    model = wide_table(("model-level detector", "verdict", "first layer", "reading"), [
        (f"<code>{escape(r.detector)}</code>", _badge(escape(r.verdict)),
         escape(report.result_layers.get(r.detector) or "-"), escape(r.message.replace(_DOCSTRING_POINTER, _PROTOCOL)))
        for r in report.results])
    return layers + model


def _cache_table(clean, broken) -> str:
    from diagnostics._html import escape

    def cell(reading) -> str:
        if reading is None:
            return "-"
        verdict = "pass" if reading["error"] <= reading["allowed"] else "fail"  # the audit's own rule (its parity judge)
        return (f"{_badge(verdict)} <span class='num'>{reading['error']:.2g}</span> (allowed "
                f"<span class='num'>{reading['allowed']:.2g}</span>)")

    broken_readings = broken.readings.get("cache_parity", {})
    return wide_table(("schedule (prefill, steps)", "correct: error", "rotary not offset: error"), [
        (f"{escape(name)} <code>{escape(good['plan'])}</code>", cell(good), cell(broken_readings.get(name)))
        for name, good in clean.readings.get("cache_parity", {}).items()])


def model_chapter_html(variants: dict) -> str:
    """The model chapter: a tiny GPT with one catalog bug in one layer, audited as a whole."""
    from diagnostics._html import escape

    reports = chapter_reports(variants)
    vid, layer = CHAPTER_BUG
    broken, clean = reports["broken"], reports["clean"]
    first = broken.result_layers.get("prefix_causality")
    return f"""<section class="model-chapter" id="model-chapter">
<h3>Model chapter: one broken layer inside a whole model</h3>
<p>A nanoGPT-style <code>TinyGPT</code> (3 blocks, d_model 32, 4 heads) whose block {layer} attention is the catalog's
<code>{escape(vid)}</code>, audited with <code>diagnostics.audit_model(model)</code>: every attention module is found,
audited in place with the arguments the model passes it, and the model-level checks run on its logits.
Status: <b>{escape(broken.status)}</b> ({escape(broken.status_reason)}); the twin with the reference attention in
every block: <b>{escape(clean.status)}</b>.</p>
{_layer_table(broken)}
<h4>How far a future change reaches, layer by layer</h4>
<p>Tokens after position {broken.readings['prefix_reach']['cut']} are changed; each bar counts the positions at or
before it whose output moved at that layer. The first layer with a bar is where the leak starts
(<code>{escape(first or '-')}</code>); the layers after it inherit it.</p>
<figure>{reach_svg(broken.readings['prefix_reach'], label='future reach per layer, broken model')}
<figcaption>with <code>{escape(vid)}</code> in block {layer}</figcaption></figure>
<figure>{reach_svg(clean.readings['prefix_reach'], label='future reach per layer, correct model')}
<figcaption>the correct twin</figcaption></figure>
<h4>Cache parity, side by side</h4>
<p>A decoder with rotary positions and a cache (<code>ProtocolGPT</code>), correct and with block {layer}'s rotary
positions not offset by the cache length: the full forward against prefill plus steps of 1, 3 and an uneven
split, error relative to the logits' RMS against a float64 copy of the model.</p>
{_cache_table(reports['cache_clean'], reports['cache_broken'])}
<p>The broken model is localised to <code>{escape(reports['cache_broken'].result_layers.get('cache_parity') or '-')}</code>.</p>
</section>"""


__all__ = ["LAYER_BUGS", "MODEL_BUGS", "ProtocolGPT", "TinyGPT", "chapter_reports", "inject", "model_chapter_html",
           "reach_svg", "wide_table"]
