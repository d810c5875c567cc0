"""The catalog of silent attention mistakes: `VARIANTS[id]` is one bug, its lesson and its layer
(`SHARDED_VARIANTS[id]`, the sharded chapter's: a layer split across processes, loaded on first use).

Every layer is `correct.MultiHeadAttention` with one step overridden (see `_catalog.py`). Each entry says
what goes wrong and why nothing crashes (`explanation`), what can be measured (`symptom`), the one-line
repair (`fix`), which `diagnostics` detectors catch it (`expected_detectors`), and the conditions under
which the bug is observable at all (`detectable_when`, a sentence and a predicate on a `Setting`).
"""

from __future__ import annotations

import torch

from diagnostics import patterns

from . import _catalog as c
from ._registry import Observable, Setting, Variant, promised_pattern

_ALWAYS = Observable("always", lambda s: True)

# The patterns of chapter 3, at the kill matrix's sequence length (16): a window of W keys, chunks of C
# positions, a prefix of P positions, and three packed documents. (Not C = 4: query_locality perturbs query 8,
# which would then start a chunk and attend itself alone, so its output could not depend on its query.)
W, C, P = 4, 5, 5
DOCS = torch.tensor([0] * 5 + [1] * 6 + [2] * 5)


def _entries() -> list[Variant]:
    return [
        Variant(
            id="missing_scale", title="Missing 1/sqrt(d_k) scale", cls=c.MissingScale, step="scale",
            explanation="Dot products of d_k-wide vectors have variance ~d_k, so without the 1/sqrt(d_k) the "
            "logits grow with the head width and the softmax saturates: attention becomes nearly one-hot and its "
            "gradients vanish. Shapes, row sums and masks all stay right, so nothing fails; the model just "
            "trains worse, more so for wider heads.",
            symptom="The temperature the softmax sees is sqrt(d_k) times too sharp; weight entropy collapses as d_k grows.",
            fix="return scores / math.sqrt(self.head_dim)",
            detectable_when=Observable("d_k > 1 (the scale is then 1) and some query may attend two or more keys "
                                       "(one logit's softmax is 1 at any temperature)",
                                       lambda s: s.d_k > 1 and s.has_choice),
            expected_detectors=("softmax_saturation",),
            also_detected_by=("own_weights",),  # the step found from the layer's own weights
        ),
        Variant(
            id="scaled_by_d_model", title="Scaled by sqrt(d_model) instead of sqrt(d_k)", cls=c.ScaledByDModel,
            step="scale",
            explanation="Dividing by the width of the whole model rather than of one head makes every logit "
            "sqrt(H) times too small: attention is too flat and barely depends on the content. Reported in "
            "karpathy/ng-video-lecture PR #6 and lucidrains/vit-pytorch#65.",
            symptom="The softmax temperature is sqrt(num_heads) times too flat.",
            fix="return scores / math.sqrt(self.head_dim)",
            detectable_when=Observable("num_heads > 1 (with one head d_model = d_k) and some query may attend two "
                                       "or more keys", lambda s: s.num_heads > 1 and s.has_choice),
            expected_detectors=("softmax_saturation",),
            also_detected_by=("own_weights",),  # the step found from the layer's own weights
        ),
        Variant(
            id="no_softmax", title="No softmax", cls=c.NoSoftmax, step="softmax",
            explanation="The raw logits are used as weights: they can be negative, rows do not sum to 1, and the "
            "output is no longer an average of the values, so its scale drifts with the sequence length. It "
            "still trains after a fashion, which is why it goes unnoticed.",
            symptom="Weights are negative and rows do not sum to 1; with a mask, -inf reaches the output.",
            fix="return torch.softmax(scores, dim=-1).masked_fill(torch.isneginf(scores).all(-1, keepdim=True), 0.0)",
            detectable_when=_ALWAYS,
            # mask_honoured does not credit it: -inf logits times the values make every masked probe's output
            # NaN, so no change can be measured there (the NaN itself is fully_masked_rows' finding)
            expected_detectors=("weight_row_sums", "output_variance", "fully_masked_rows"),
            also_detected_by=("gradients",),  # with a padding mask the output is -inf @ v: NaN, gradients too
        ),
        Variant(
            id="mask_after_softmax", title="Mask applied after the softmax", cls=c.MaskAfterSoftmax,
            step="mask_then_softmax",
            explanation="Normalising first and zeroing the blocked weights afterwards leaves the kept weights "
            "summing to less than 1, and the blocked keys still shape them through the normaliser: change a "
            "padded key and every output moves.",
            symptom="Rows with a blocked key sum to < 1; outputs depend on keys that are masked out.",
            fix="return self.softmax(self.mask(scores, mask))",
            detectable_when=Observable("some query row has both blocked and allowed keys",
                                       lambda s: s.has_partly_masked_row),
            expected_detectors=("weight_row_sums", "mask_honoured"),
            # the normaliser sends gradient to the masked keys; the kept weights sum to less than one, unlike the
            # sequence cut to its length
            also_detected_by=("gradients", "blocked_keys_absent"),
        ),
        Variant(
            id="missing_causal_mask", title="Causal decoder without its causal mask", cls=c.MissingCausalMask,
            step="mask", layer_kwargs={"causal": True},
            explanation="The layer promises causality but never applies its mask, so every token sees the "
            "future. Training loss looks excellent (the model copies the next token) and generation is garbage.",
            symptom="Changing only tokens after t changes the outputs at and before t.",
            fix="apply correct.causal_mask(Tq, Tk, align='bottom_right') before the user's mask",
            detectable_when=Observable("the causal mask blocks a key the user's mask allows (T > 1)",
                                       lambda s: bool((s.allowed(align=None) & ~s.allowed()).any())),
            expected_detectors=("future_leakage",),
            # the future leaks through the backward pass too; the layer's own weights recompute its output with the
            # causal mask left out (own_weights' step "the mask the call passed not applied")
            also_detected_by=("gradients", "own_weights"),
        ),
        Variant(
            id="swapped_self_cross", title="Self- and cross-attention inputs swapped", cls=c.SwappedSelfCross,
            step="project",
            explanation="A cross-attention layer must take its queries from the decoder stream and its keys and "
            "values from the encoder memory. Swapped, the output has one row per memory token and mixes decoder "
            "rows; when the two lengths happen to match, nothing even fails.",
            symptom="Output length is Tk instead of Tq; each output row depends on every query row.",
            fix="return F.linear(query, w_q, b_q), F.linear(key, w_k, b_k), F.linear(value, w_v, b_v)",
            detectable_when=Observable("query and memory are different tensors, and Tq != Tk (the output has the "
                                       "wrong length) or some query may attend a key",
                                       lambda s: not s.self_attention and (s.t_q != s.t_k or s.attends_anything)),
            expected_detectors=("output_shape", "query_locality", "keys_matter"),  # the value input is never read
            # outputs mix the query rows, not the memory's values; and a changed padded key is now a query,
            # whose output row moves although the mask blocks it
            also_detected_by=("output_variance", "mask_honoured", "gradients"),  # the mask reaches the wrong keys
        ),
        Variant(
            id="non_contiguous_view", title="view() after transpose() without .contiguous()",
            cls=c.NonContiguousView, step="merge_heads",
            explanation="transpose() returns a strided view; view() cannot merge the head and width dimensions "
            "of it and raises. It works on the degenerate shapes where the merged dimensions are still "
            "laid out in order: one head (H = 1), one query (Tq = 1) or one-wide heads (d_k = 1); size-1 "
            "dimensions have no stride to get wrong. So it passes a test on tiny inputs or during one-token "
            "decoding, then crashes in training.",
            symptom="RuntimeError 'view size is not compatible with input tensor's size and stride' when H, Tq, d_k > 1.",
            fix="return x.transpose(1, 2).contiguous().view(B, T, H * d_k)",
            detectable_when=Observable("num_heads > 1, Tq > 1 and d_k > 1 (H = 1, Tq = 1 or d_k = 1 happen to work)",
                                       lambda s: s.num_heads > 1 and s.t_q > 1 and s.d_k > 1),
            expected_detectors=("runs",),
        ),
        Variant(
            id="softmax_wrong_dim", title="Softmax over the wrong axis", cls=c.SoftmaxWrongDim, step="softmax",
            explanation="softmax(dim=-2) normalises over queries, not keys: each key's column sums to 1, query "
            "rows do not, and a query's weights depend on every other query. Reported in PetrochukM/PyTorch-NLP#2.",
            symptom="Weight rows do not sum to 1; an output row changes when another query changes.",
            fix="return torch.softmax(scores, dim=-1).masked_fill(torch.isneginf(scores).all(-1, keepdim=True), 0.0)",
            detectable_when=Observable("unless the allowed (query, key) pairs match one to one: every key allowed "
                                       "to exactly one query, every query at most one key (e.g. Tq = Tk = 1)",
                                       lambda s: not _one_to_one(s.allowed())),
            expected_detectors=("weight_row_sums",),
            # weak where the logits are tiny: at std-0.02 initialisation the softmax over queries is nearly
            # uniform, and in bfloat16 another query moves a row by about 1% of the output's RMS (below the
            # 1.6% allowed); output_variance is weak where the output projection is tiny (d_model = 1).
            # mask_honoured does not credit it: a key blocked for every query is an all -inf column, whose
            # softmax over queries is NaN everywhere, so no change can be measured; for the same reason the
            # gradient check's padding mask makes its output NaN.
            also_detected_by=("query_locality", "output_variance", "gradients"),
        ),
        Variant(
            id="heads_merged_without_transpose", title="Heads merged without their transpose",
            cls=c.HeadsMergedWithoutTranspose, step="merge_heads",
            explanation="reshape() of (B, H, T, d_k) straight to (B, T, D) lays head h's positions side by side, "
            "so output row t is built from other positions and other heads. Shapes are right and it still "
            "trains. Reported in reczoo/FuxiCTR#30 and jsbaan/transformer-from-scratch PR #6.",
            symptom="Output row t depends on queries at other positions; a causal layer leaks the future.",
            fix="return x.transpose(1, 2).contiguous().view(B, T, H * d_k)",
            detectable_when=Observable("num_heads > 1 and Tq > 1", lambda s: s.num_heads > 1 and s.t_q > 1),
            expected_detectors=("output_variance", "query_locality", "mask_honoured"),
            # the step found from the layer's own weights; the padded positions' heads reach the kept rows
            also_detected_by=("own_weights", "blocked_keys_absent"),
        ),
        Variant(
            id="mask_polarity_inverted", title="Boolean mask polarity inverted", cls=c.MaskPolarityInverted,
            step="mask",
            explanation="nn.MultiheadAttention reads True as 'blocked', F.scaled_dot_product_attention as 'may "
            "attend'. Mixing the two attends exactly to the padding (or the future) and ignores the real tokens. "
            "Reported in pytorch/pytorch#170400 and rasbt/LLMs-from-scratch#1061.",
            symptom="Outputs change when masked keys change, and ignore the keys that are allowed.",
            fix="return scores if mask is None else scores.masked_fill(~mask, fill)",
            detectable_when=Observable("a boolean mask is passed", lambda s: s.mask is not None),
            expected_detectors=("mask_honoured",),
            # the blocked keys are the attended ones, gradient and all, and the cut sequence's keys all blocked
            also_detected_by=("gradients", "blocked_keys_absent"),
        ),
        Variant(
            id="causal_mask_misaligned", title="Causal mask aligned top-left when decoding with a cache",
            cls=c.CausalMaskMisaligned, step="mask", layer_kwargs={"causal": True},
            explanation="With a KV cache the queries are the *last* Tq positions. A top-left causal mask (what "
            "is_causal=True builds in torch) lets query i see keys <= i, so a new token sees only the start of "
            "the context. Full-sequence training (Tq = Tk) is unaffected, so it hides until generation. "
            "pytorch/pytorch#108108; flash-attention switched to bottom-right in v2.1.",
            symptom="With Tq < Tk the newest query ignores the newest keys, itself included.",
            fix="causal = correct.causal_mask(t_q, t_k, align='bottom_right', device=scores.device)",
            detectable_when=Observable("Tq != Tk (where the two alignments differ on keys the user allows)",
                                       lambda s: bool((s.allowed(align="top_left") != s.allowed()).any())),
            expected_detectors=("causal_alignment", "decode_consistency"),
        ),
        Variant(
            id="causal_diagonal_masked", title="Causal mask that also blocks the diagonal",
            cls=c.CausalDiagonalMasked, step="mask", layer_kwargs={"causal": True},
            explanation="triu(diagonal=0) instead of triu(diagonal=1) blocks each token from itself: the first "
            "token sees nothing (NaN, or zeros with a safe softmax) and every token predicts from strictly "
            "earlier ones. Reported in pbloem/former#10.",
            symptom="A query's output does not depend on the key at its own position.",
            fix="causal = correct.causal_mask(t_q, t_k, align='bottom_right', device=scores.device)",
            detectable_when=Observable("the user's mask allows some query its own position",
                                       lambda s: bool((s.allowed() != _without_diagonal(s)).any())),
            expected_detectors=("weight_row_sums", "output_variance", "causal_alignment"),
            # with Tk = 2 each query keeps one key, so the output no longer depends on the keys at all, nor on
            # the query and key projections (their gradients are exactly zero)
            detected_at_other_sizes_by=("keys_matter", "parameters_used"),
        ),
        Variant(
            id="dropout_in_eval", title="Attention dropout left on in eval mode", cls=c.DropoutInEval,
            step="dropout", layer_kwargs={"dropout": 0.1},
            explanation="Dropout on the weights must be a no-op after model.eval(). Forcing training=True (or "
            "passing dropout_p to fused SDPA without a self.training check) makes inference random and rescales "
            "the kept weights. pytorch/pytorch#124464, pytorch-image-models PR #1978.",
            symptom="Two eval-mode calls on the same input differ; weight rows do not sum to 1.",
            fix="return F.dropout(weights, p=self.dropout_p, training=self.training)",
            detectable_when=Observable("dropout > 0, the layer is in eval mode, and some query may attend a key",
                                       lambda s: s.dropout > 0 and not s.training and s.attends_anything),
            expected_detectors=("weight_row_sums",),  # the 1/(1-p) rescaling, even when nothing is dropped
            also_detected_by=("output_variance", "query_locality", "mask_honoured", "eval_determinism",
                              "blocked_keys_absent"),  # two calls, two draws of the dropout
        ),
        Variant(
            id="fully_masked_row_nan", title="Fully masked row gives NaN", cls=c.FullyMaskedRowNaN,
            step="softmax", expected_severity="warn",
            explanation="softmax of a row whose every key is -inf is 0/0 = NaN, which then spreads through the "
            "output projection into the loss and the gradients (pytorch/pytorch#41508). torch's SDPA returns "
            "zeros for such rows; many correct layers (nn.MultiheadAttention with weights) still give NaN, "
            "so this is a warning, not a failure.",
            symptom="NaN in the rows of queries that may attend no key.",
            fix="return torch.softmax(scores, dim=-1).masked_fill(torch.isneginf(scores).all(-1, keepdim=True), 0.0)",
            detectable_when=Observable("some query row has every key blocked", lambda s: s.has_fully_masked_row),
            expected_detectors=("fully_masked_rows",),
        ),
        # ---- chapter 2: batches stay apart, keys matter, decoding equals the full pass, causal under
        # padding, the temperature actually used, gradients (issue 9)
        Variant(
            id="heads_merged_sequence_first", title="Heads merged in sequence-first order",
            cls=c.HeadsMergedSequenceFirst, step="merge_heads",
            explanation="permute(2, 0, 1, 3) is the (T, B, H, d_k) layout of seq-first code; reshaping it to "
            "(B, T, D) interleaves the batch with time, so a sequence's output rows come from other sequences of "
            "the batch. With batch size 1, the way single examples are usually tried, it is exactly right "
            "(llama.cpp #249 and transformers' test_batching_equivalence exist for this family).",
            symptom="A sequence's output changes when another sequence of the same batch changes.",
            fix="return x.transpose(1, 2).contiguous().view(B, T, H * d_k)",
            detectable_when=Observable("two or more sequences in the batch and Tq > 1",
                                       lambda s: s.batch > 1 and s.t_q > 1),
            expected_detectors=("batch_independence",),
            # rows then carry other positions' and other sequences' outputs: what stacking probes along the
            # batch or moving one position shows, at most sizes
            # the padded positions' heads reach the kept rows, as other sequences' do
            also_detected_by=("query_locality", "output_variance", "mask_honoured", "blocked_keys_absent"),
            # probes stacked along the batch are mixed with each other: any stacked comparison may fire
            detected_at_other_sizes_by=("keys_matter", "future_leakage", "decode_consistency", "causal_alignment",
                                        "eval_determinism", "gradients"),
        ),
        Variant(
            id="keys_from_query_stream", title="Keys projected from the query stream", cls=c.KeysFromQueryStream,
            step="project",
            explanation="In cross-attention the keys must come from the memory; projecting them from the query "
            "stream makes every query score itself against the decoder tokens while the values come from the "
            "memory. Weights still sum to 1 and outputs stay convex; with Tq = Tk it runs silently.",
            symptom="The output does not change when the key input changes.",
            fix="return F.linear(query, w_q, b_q), F.linear(key, w_k, b_k), F.linear(value, w_v, b_v)",
            detectable_when=Observable("cross-attention (query and memory differ), and some query may attend two "
                                       "keys (one key's weight is 1 whatever the scores), or 1 != Tq != Tk (it raises; "
                                       "with Tq = 1 the one score broadcasts over the keys)",
                                       lambda s: not s.self_attention and (s.has_choice or s.t_q not in (1, s.t_k))),
            expected_detectors=("keys_matter",),
            also_detected_by=("runs", "query_locality"),  # with Tq != Tk the scores and the values disagree: it raises
        ),
        Variant(
            id="padding_mask_replaces_causal", title="Padding mask replaces the causal mask",
            cls=c.PaddingMaskReplacesCausal, step="mask", layer_kwargs={"causal": True},
            explanation="A decoder that builds its causal mask only when the caller passes no mask is causal in "
            "every maskless test and leaks the future as soon as a padding mask is passed, which is how it is "
            "trained on batches of unequal lengths.",
            symptom="With a padding mask, outputs depend on later tokens.",
            fix="if self.causal:",
            detectable_when=Observable("a mask is passed that allows some query a later key",
                                       lambda s: s.mask is not None and bool(
                                           (s.allowed(align=None) & ~s.allowed(user_mask=False)).any())),
            expected_detectors=("future_leakage",),
        ),
        Variant(
            id="double_softmax", title="Softmax applied twice", cls=c.DoubleSoftmax, step="softmax",
            explanation="A helper that already returns probabilities, normalised again: the second softmax of "
            "numbers in [0, 1] is nearly uniform. Rows still sum to 1 and outputs stay convex, so only the "
            "temperature of the weights that multiply the values shows it; masked keys (weight 0) get e^0 "
            "weight back.",
            symptom="The weights used are far flatter than softmax(q·k / sqrt(d_k)); masked keys get weight.",
            fix="return torch.softmax(scores, dim=-1).masked_fill(torch.isneginf(scores).all(-1, keepdim=True), 0.0)",
            detectable_when=Observable("Tk >= 2, or a query with no key (the second softmax makes its zeros uniform)",
                                       lambda s: s.t_k >= 2 or s.has_fully_masked_row),
            expected_detectors=("softmax_saturation",),
            # masked keys get e^0 weight back, and gradient, which the sequence cut to its length does not give them
            also_detected_by=("mask_honoured", "gradients", "blocked_keys_absent"),
            # in bfloat16, where permuting the keys moves the outputs by rounding above the bar, the shift is measured
            # and its masked padding leaks (a consequence of mask_honoured; an exploring CI seed's draw, 3333); and
            # own_weights where the logits are small (GPT-2's init at d_model 4, seq_len 2: an exploring seed's draw,
            # 31337): softmax(softmax(s)) is then the layer's own weights' attention at another scale, the step it
            # names (5 of 200 random draws of the catch test's sizes; never at the kill matrix's)
            detected_at_other_sizes_by=("relative_positions", "own_weights"),
        ),
        Variant(
            id="detached_softmax", title="Attention weights detached from the graph", cls=c.DetachedSoftmax,
            step="softmax",
            explanation="A .detach() (or a torch.no_grad() block) around the weights keeps the forward pass "
            "exact and stops every gradient through q and k: W_Q and W_K never learn, the model trains as a "
            "bag of values, and no forward test can tell.",
            symptom="Autograd's gradient disagrees with finite differences of the layer.",
            fix="return torch.softmax(scores, dim=-1).masked_fill(torch.isneginf(scores).all(-1, keepdim=True), 0.0)",
            detectable_when=Observable("gradients are taken and some query may attend two or more keys",
                                       lambda s: s.backward and s.has_choice),
            expected_detectors=("gradients",),
        ),
        Variant(
            id="rotary_not_offset", title="Rotary positions of new queries not offset by the cache",
            cls=c.RotaryNotOffset, step="positions", layer_kwargs={"causal": True, "rotary": True},
            explanation="With a KV cache of Tk - Tq tokens, the new queries sit at positions Tk - Tq .. Tk - 1. "
            "Rotating them as 0 .. Tq - 1 (the positions of the chunk itself) shifts every query-key distance "
            "by the cache length: training and the prefill (Tq = Tk) are exact, and every decoding step after "
            "them attends as if the new token stood at the start. executorch PR #2010, moeut PR #6, "
            "LLMs-from-scratch PR #697.",
            symptom="Decoding the last Tq queries over all Tk keys differs from the last rows of the full pass.",
            fix="return torch.arange(t_k - t_q, t_k, device=device), torch.arange(t_k, device=device)",
            detectable_when=Observable("Tq != Tk, d_k >= 2 (a rotary pair to turn) and some query may attend two "
                                       "or more keys (one key takes all the weight at any position)",
                                       lambda s: s.t_q != s.t_k and s.d_k >= 2 and s.has_choice),
            expected_detectors=("decode_consistency",),
        ),
        # ---- chapter 3: attention patterns beyond causal, audited with the pattern they promise (issue 19)
        Variant(
            id="window_one_too_long", title="Sliding window one key too long", cls=c.WindowOneTooLong,
            step="within_window", layer_kwargs={"sliding_window": W}, pattern=patterns.sliding_window(W),
            explanation="A window of W keys means the query's own key and the W - 1 before it (Mistral's and "
            "Gemma's convention). Counting W keys *back* (q - kv <= W, or a mask built with triu(diagonal=-W)) "
            "lets every query see W + 1: nothing crashes, training is slightly different from the model it is "
            "meant to match, and a cache sized for W keys disagrees with the full pass (cf. mlx-lm PR #390, "
            "window vs window + 1; NeMo PR #9672, Gemma 2's window off by one).",
            symptom="A query's output depends on the key exactly W positions back, which the window blocks.",
            fix="return (kv_idx <= q_idx) & (q_idx - kv_idx < self.sliding_window)",
            detectable_when=Observable(f"a query at position q >= W (W = {W}) whose key q - W the caller's mask "
                                       "allows", lambda s: _differs(s, _window(W + 1))),
            expected_detectors=("attention_pattern",),
        ),
        Variant(
            id="window_one_too_short", title="Sliding window one key too short", cls=c.WindowOneTooShort,
            step="within_window", layer_kwargs={"sliding_window": W}, pattern=patterns.sliding_window(W),
            explanation="Converting between 'W keys including the query's own' and 'W keys back' twice (q - kv "
            "< W - 1) leaves W - 1 keys: the oldest key of every full window is never seen. Nothing leaks, so "
            "no leakage test can find it; the model just has less context than it was designed for.",
            symptom="A query's output does not depend on the key W - 1 positions back, which the window allows.",
            fix="return (kv_idx <= q_idx) & (q_idx - kv_idx < self.sliding_window)",
            detectable_when=Observable(f"a query at position q >= W - 1 (W = {W}) whose key q - W + 1 the caller's "
                                       "mask allows", lambda s: _differs(s, _window(W - 1))),
            expected_detectors=("attention_pattern",),
            also_detected_by=("weight_row_sums",),  # a row whose keys the padding probe leaves it attends none
        ),
        Variant(
            id="window_on_both_sides", title="Sliding window applied on both sides", cls=c.WindowOnBothSides,
            step="within_window", layer_kwargs={"sliding_window": W}, pattern=patterns.sliding_window(W),
            explanation="|q - kv| < W is a local window for an encoder; in a decoder it lets each query see the "
            "W - 1 keys after it as well (flash-attention's window_size=(W, W) attends 2W + 1 keys). The causal "
            "mask was meant to come from the window, so the future leaks: training loss drops, generation fails.",
            symptom="Changing a token changes the outputs of the W - 1 tokens before it.",
            fix="return (kv_idx <= q_idx) & (q_idx - kv_idx < self.sliding_window)",
            detectable_when=Observable("a query whose next key (within W - 1 positions after it) the caller's mask "
                                       "allows", lambda s: _differs(s, lambda b, h, q, kv: (q - kv).abs() < W)),
            expected_detectors=("attention_pattern",),
        ),
        Variant(
            id="chunk_boundary_one_late", title="Chunk boundaries one position late", cls=c.ChunkBoundaryOneLate,
            step="within_chunk", layer_kwargs={"attention_chunk_size": C}, pattern=patterns.chunked(C),
            explanation="Chunked attention (Llama 4) lets a query see the keys of its own chunk of C positions, up "
            "to itself. Chunk ids computed from 1-based positions ((q - 1) // C) move every boundary one late: the "
            "first query of each chunk sees the previous chunk, and its first key is cut off from the rest of "
            "its own. Both are silent, and invisible at sequences shorter than C.",
            symptom="The first query of a chunk depends on keys of the previous chunk; the first key of a chunk is "
                    "ignored by the queries after it.",
            fix="return (kv_idx <= q_idx) & (q_idx // C == kv_idx // C)",
            detectable_when=Observable(f"a query and a key on either side of a chunk boundary (C = {C}) that the "
                                       "caller's mask allows",
                                       lambda s: _differs(s, lambda b, h, q, kv: (kv <= q) & ((q - 1) // C ==
                                                                                             (kv - 1) // C))),
            expected_detectors=("attention_pattern",),
            # a row whose keys the padding probe leaves it attends none, where the padding ends at a boundary; at
            # T = 2 each query keeps its own key alone, so the output no longer depends on the keys (nor W_K)
            detected_at_other_sizes_by=("weight_row_sums", "keys_matter", "parameters_used"),
        ),
        Variant(
            id="documents_not_masked", title="Packed documents attend to each other", cls=c.DocumentsNotMasked,
            step="same_document", layer_kwargs={"documents": DOCS}, pattern=patterns.document(DOCS),
            explanation="Packing several documents (or images, as NaViT does) into one sequence needs a "
            "block-diagonal mask, or cu_seqlens for a varlen kernel; resetting the position ids at each document "
            "start is not enough. A mask that ignores the document ids lets every document attend to the others "
            "packed beside it: the model learns from unrelated text, and its outputs for one document depend "
            "on what it was packed with.",
            symptom="A token's output changes when a token of another document in the same sequence changes.",
            fix="return ids[row, q_idx.clamp(max=last)] == ids[row, kv_idx.clamp(max=last)]",
            detectable_when=Observable("a query and a key of another document that the caller's mask allows",
                                       lambda s: _differs(s, lambda b, h, q, kv: kv >= 0)),
            expected_detectors=("attention_pattern",),
        ),
        Variant(
            id="causal_prefix", title="Prefix-LM prefix made causal", cls=c.CausalPrefix, step="prefix_lm",
            layer_kwargs={"prefix": P}, pattern=patterns.prefix_lm(P),
            explanation="In a prefix-LM (T5's prefix-LM, PaliGemma) the prefix (the image, the prompt) is read "
            "bidirectionally and the rest causally. A causal mask applied on top of the prefix mask undoes it: "
            "each prefix token sees only the ones before it, the model runs as a plain decoder, and nothing "
            "leaks, so no causality test fails.",
            symptom="A prefix token's output does not depend on the later prefix tokens.",
            fix="return (kv_idx <= q_idx) | (kv_idx < self.prefix)",
            detectable_when=Observable(f"a query inside the prefix (P = {P}) and a later prefix key that the "
                                       "caller's mask allows", lambda s: _differs(s, lambda b, h, q, kv: kv <= q)),
            expected_detectors=("attention_pattern",),
        ),
        Variant(
            id="window_dropped_with_cache", title="Sliding window dropped once a cache holds keys",
            # a causal decoder with a window: the decoding detectors judge causal layers
            cls=c.WindowDroppedWithCache, step="pattern_mask", layer_kwargs={"causal": True, "sliding_window": W},
            pattern=patterns.sliding_window(W),
            explanation="The window's mask is built for the prompt (Tq = Tk) and skipped when the queries are "
            "fewer than the keys, as in decoding with a KV cache: each new token then attends to every cached "
            "key. Training and the prefill are exact; generation past W tokens drifts (cf. nanochat #452, the "
            "single-token path ignores the window; sglang PR #4823, the window never passed).",
            symptom="Decoding the last Tq queries over all Tk keys differs from the last rows of the full pass.",
            fix="return mask_from_mod(self.pattern, t_q, t_k, batch=batch, device=device)",
            detectable_when=Observable(f"Tq < Tk, and a query at position q >= W (W = {W}) has a key older than its "
                                       "window that the caller's mask allows",
                                       lambda s: s.t_q < s.t_k and _differs(s, lambda b, h, q, kv: kv >= 0)),
            # the pattern measured while decoding (the last Tq queries over all Tk keys) shows the leak at any size;
            # comparing the decoded rows with the full pass (decode_consistency) shows it where the keys beyond
            # the window carry weight enough to move a row past rounding: not at every size in bfloat16
            expected_detectors=("attention_pattern",), also_detected_by=("decode_consistency",),
        ),
    ]


def _one_to_one(allowed: torch.Tensor) -> bool:
    """Normalising over keys and over queries agree only when the allowed pairs form a partial matching."""
    return bool((allowed.sum(dim=-2) == 1).all() and (allowed.sum(dim=-1) <= 1).all())


def _without_diagonal(s: Setting) -> torch.Tensor:
    """`s.allowed()` less each query's own position (i, i + Tk - Tq), as triu(diagonal=0) blocks it."""
    i = torch.arange(s.t_q).unsqueeze(-1)  # (Tq, 1)
    j = torch.arange(s.t_k)  # (Tk,)
    return s.allowed() & (j != i + s.t_k - s.t_q)  # (Tq, Tk)


def _window(width: int):
    """A sliding window of `width` keys, the query's own included, as a mask_mod."""
    return lambda b, h, q, kv: (kv <= q) & (q - kv < width)


def _differs(s: Setting, pattern) -> bool:
    """With `pattern` in place of the layer's own, some query of this call would attend other keys."""
    return bool((s.allowed(pattern=pattern) != s.allowed()).any())


VARIANTS: dict[str, Variant] = {v.id: v for v in _entries()}


def __getattr__(name: str):
    """`SHARDED_VARIANTS` (the sharded chapter, `_sharded.py`: layers split across processes, audited by
    `diagnostics.distributed.audit_sharded`), loaded on first use: the catalog itself needs no process group."""
    if name in ("SHARDED_VARIANTS", "ShardedVariant", "ShardedSetting"):
        from . import _sharded

        return getattr(_sharded, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = ["Observable", "SHARDED_VARIANTS", "Setting", "ShardedSetting", "ShardedVariant", "VARIANTS", "Variant",
           "promised_pattern"]
