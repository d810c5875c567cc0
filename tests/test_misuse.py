"""Misuse is an `AuditUsageError` saying what was expected, what was seen and the fix, raised before any probe
runs: never a TypeError from deep inside, an assert, or a "finding" about a layer that was called wrongly."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import diagnostics
from correct import MultiHeadAttention
from diagnostics import AuditUsageError
from diagnostics._subject import check_seq_len, context_length, make_subject


def sdpa(q, k, v, mask=None):
    return torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask)


class NanoGPTAttention(nn.Module):
    """nanoGPT's CausalSelfAttention: its causal mask is a (1, 1, block_size, block_size) buffer."""

    def __init__(self, n_embd=32, n_head=4, block_size=8):
        super().__init__()
        self.n_embd, self.n_head = n_embd, n_head
        self.c_attn, self.c_proj = nn.Linear(n_embd, 3 * n_embd), nn.Linear(n_embd, n_embd)
        causal = torch.tril(torch.ones(block_size, block_size))  # (T, T)
        self.register_buffer("bias", causal.view(1, 1, block_size, block_size))

    def forward(self, x):
        B, T, D = x.shape
        q, k, v = self.c_attn(x).view(B, T, 3, self.n_head, D // self.n_head).permute(2, 0, 3, 1, 4)
        scores = (q @ k.transpose(-2, -1)) / (D // self.n_head) ** 0.5  # (B, H, T, T)
        scores = scores.masked_fill(self.bias[:, :, :T, :T] == 0, float("-inf"))
        return self.c_proj((scores.softmax(-1) @ v).transpose(1, 2).reshape(B, T, D))


class WithConfig(nn.Module):
    """A Hugging Face-style layer: sizes and the context on a config object."""

    class Config:
        hidden_size, num_attention_heads, max_position_embeddings = 32, 4, 12

    def __init__(self):
        super().__init__()
        self.config, self.q = self.Config(), nn.Linear(32, 32)

    def forward(self, x, attention_mask=None):
        return self.q(x)


@pytest.mark.parametrize("call, words", [
    (lambda: make_subject(MultiHeadAttention), "expected an attention layer instance; got the class "
                                               "MultiHeadAttention. Fix: pass an instance, e.g. "
                                               "MultiHeadAttention(...)"),
    (lambda: make_subject(MultiHeadAttention(32, 4), d_model="32"), "expected d_model an int or None; got "
                                                                   "d_model='32' (str). Fix: pass a whole number"),
    (lambda: make_subject(MultiHeadAttention(32, 4), num_heads=True), "got num_heads=True (bool)"),
    (lambda: make_subject(MultiHeadAttention(32, 4), num_heads=-1), "expected num_heads >= 1; got num_heads=-1"),
    (lambda: make_subject(MultiHeadAttention(32, 4), num_heads=0), "expected num_heads >= 1; got num_heads=0"),
    (lambda: make_subject(MultiHeadAttention(32, 4), num_heads=5), "got d_model=32 and num_heads=5, which leave 2. "
                                                                   "Fix: choose num_heads in {1, 2, 4, 8, 16, 32}"),
    (lambda: make_subject(MultiHeadAttention(32, 4), d_model=30), "expected d_model to match the width of the "
                                                                  "layer's projections (nn.Linear in_features [32]); "
                                                                  "got d_model=30. Fix: pass the layer's width, "
                                                                  "d_model=32"),
    (lambda: make_subject(nn.MultiheadAttention(32, 4), num_heads=2), "expected num_heads=4, as the "
                                                                      "nn.MultiheadAttention has it"),
    (lambda: make_subject(sdpa, d_model=33, num_heads=2), "got d_model=33 and num_heads=2"),
    (lambda: make_subject(sdpa, device="no_such_device"), "expected a torch device; got device='no_such_device'"),
    (lambda: make_subject(sdpa, dtype="float32"), "expected dtype a floating-point torch.dtype or None"),
    (lambda: check_seq_len(make_subject(NanoGPTAttention()), None), "expected seq_len <= 8, the longest sequence the "
                                                                    "layer takes (the (1, 1, 8, 8) buffer bias); got "
                                                                    "seq_len=16 (the default). Fix: pass seq_len=8"),
    (lambda: check_seq_len(make_subject(WithConfig()), 16), "expected seq_len <= 12, the longest sequence the layer "
                                                            "takes (config.max_position_embeddings=12)"),
    (lambda: check_seq_len(make_subject(sdpa), 2.5), "expected seq_len an int or None; got seq_len=2.5 (float)"),
    (lambda: check_seq_len(make_subject(sdpa), 0), "expected seq_len >= 1; got seq_len=0"),
    (lambda: make_subject(nn.LSTM(8, 8)), "expected an attention layer: a function f(q, k, v, mask=None) or an "
                                          "nn.Module; got torch.nn.LSTM, a recurrent layer"),
    (lambda: make_subject(nn.GRU(8, 8, batch_first=True)), "got torch.nn.GRU, a recurrent layer"),  # was FAILED
    (lambda: make_subject(nn.MultiheadAttention(32, 4, device="meta")), "expected a layer whose parameters hold "
                                                                        "values (on cpu or cuda); got its parameters "
                                                                        "on the meta device"),
    (lambda: make_subject(sdpa, device="meta"), "expected a device that holds values (cpu or cuda); got "
                                                "device='meta'"),
    (lambda: diagnostics.audit(sdpa, progress=5), "expected progress a callable(detector_id, index, total), None "
                                                  "(a bar on a terminal for long audits) or False; got progress=5 (int)"),
])
def test_misuse_says_what_was_expected_and_the_fix(call, words):
    with pytest.raises(AuditUsageError) as raised:
        call()
    assert words in str(raised.value) and "Fix: " in str(raised.value)


@pytest.mark.skipif(torch.cuda.is_available(), reason="a CUDA device is there: device='cuda' is fine")
def test_a_device_this_torch_cannot_use_is_misuse_not_an_assert():
    with pytest.raises(AuditUsageError, match=r"expected a device this torch can use \(cpu\); got device='cuda'"):
        diagnostics.audit(sdpa, device="cuda")


def test_audit_refuses_a_class_and_sizes_of_the_wrong_kind():
    with pytest.raises(AuditUsageError, match="pass an instance, e.g. MultiHeadAttention"):
        diagnostics.audit(MultiHeadAttention)
    with pytest.raises(AuditUsageError, match="expected d_model an int or None"):
        diagnostics.audit(MultiHeadAttention(32, 4), d_model="32")
    with pytest.raises(AuditUsageError, match="expected num_heads >= 1"):
        diagnostics.audit(sdpa, num_heads=0)


def test_what_fits_the_layer_is_accepted():
    """The twins: the same layers, called as they can be, pass validation."""
    assert make_subject(MultiHeadAttention(32, 4), d_model=32, num_heads=4).num_heads == 4
    assert make_subject(sdpa, d_model=33).num_heads == 1  # an odd width gets one head, not a misuse error
    assert make_subject(nn.MultiheadAttention(32, 4, device="meta").to_empty(device="cpu")).device.type == "cpu"
    assert make_subject(sdpa, device="cpu").device.type == "cpu"
    seen = []
    diagnostics.audit(sdpa, detectors=["runs", "output_shape"], progress=lambda *step: seen.append(step))
    assert seen == [("runs", 0, 2), ("output_shape", 1, 2)]
    assert check_seq_len(make_subject(NanoGPTAttention()), 8) == 8
    assert check_seq_len(make_subject(MultiHeadAttention(32, 4)), None) == 16
    assert context_length(NanoGPTAttention(block_size=64)) == (64, "the (1, 1, 64, 64) buffer bias")
    assert context_length(MultiHeadAttention(32, 4)) is None and context_length(sdpa) is None


def test_a_bias_buffer_that_is_no_mask_does_not_bound_seq_len():
    """A square buffer named `bias` bounds the probe length only where it can be a mask (bool, 0/1, 0/-inf):
    x-transformers' ALiBi caches its bias (distances times slopes) as `bias` on the last call's shape, which once
    refused every audit with "expected seq_len <= 4" (benchmarks/pypi_bugs.py, xtr_alibi_cache_shapes). Its twin,
    the same buffer holding a causal mask (ones, or an additive 0/-inf one), still bounds it."""
    T = 4
    distances = -(torch.arange(T)[None, :] - torch.arange(T)[:, None]).abs().float()  # (T, T)
    alibi = nn.Module()
    alibi.register_buffer("bias", distances[None] * torch.tensor([0.5, 0.25])[:, None, None], persistent=False)
    assert context_length(alibi) is None
    for mask in (torch.ones(T, T).tril(), torch.zeros(T, T).masked_fill(torch.ones(T, T).triu(1).bool(), -torch.inf),
                 torch.ones(T, T, dtype=torch.bool).tril()):
        causal = nn.Module()
        causal.register_buffer("bias", mask[None, None])
        assert context_length(causal) == (T, f"the (1, 1, {T}, {T}) buffer bias")
    one = nn.Module()
    one.register_buffer("bias", torch.zeros(1, 4, 1, 1))  # a cache built on a one-token call: no context of 1
    assert context_length(one) is None


class TinyLM(nn.Module):
    """Token ids -> one attention layer -> logits: the smallest model `audit_model` takes."""

    def __init__(self):
        super().__init__()
        self.wte, self.attn, self.head = nn.Embedding(20, 16), MultiHeadAttention(16, 2), nn.Linear(16, 20)

    def forward(self, input_ids):
        x = self.wte(input_ids)
        return self.head(x + self.attn(x)[0])


def test_audit_model_takes_progress_as_audit_does():
    """`progress=False` (nothing drawn), as `audit` takes it, crashed the model audit ("'bool' object is not
    callable"); anything else than a callable, None or False is a usage error saying so."""
    example = torch.randint(0, 20, (1, 8), generator=torch.Generator().manual_seed(0))
    report = diagnostics.audit_model(TinyLM(), example=example, detectors=["model_runs"], progress=False)
    assert report.result("model_runs").verdict == "pass", report
    with pytest.raises(AuditUsageError, match=r"expected progress a callable\(stage, index, total\), None or False"):
        diagnostics.audit_model(TinyLM(), example=example, progress=5)
