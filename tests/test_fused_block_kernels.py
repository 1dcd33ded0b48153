"""The ring's block kernels on CUDA: torch's fused flash / memory-efficient kernels, chosen per block.

No GPU runs CI, so the CUDA path is checked two ways on CPU:

- on the ``meta`` device, which torch's own shape functions for the CUDA ops run on: the calls' arguments,
  the outputs' shapes and dtypes, the padded LSE of the efficient kernel, the grouped K/V heads summed back;
- on CPU with the four CUDA ops emulated (plain torch, each op's own conventions: the flash kernel's causal
  mask is bottom-right on a non-square block, the efficient kernel's LSE rows are padded with NaN to a
  multiple of 32 and its backward reads the padded layout): the glue's numbers against the reference kernels,
  odd shapes, GQA, fp32 / bf16, with the stand-in output and with the real one.

``benchmarks/gpu_check.py`` runs the same kernels on a real GPU.
"""
from __future__ import annotations

import pytest
import torch

from burstc.kernels import attention_blocks as blocks
from burstc.kernels.attention_blocks import (block_attention_backward, block_attention_forward, block_kernel,
                                             reference_block_backward, reference_block_forward)
from burstc.ops.lse_merge import attention_delta
from burstc.testing.oracle import tolerance


@pytest.fixture
def fused_on(monkeypatch):
    def use(device_type: str):
        monkeypatch.setattr(blocks, "FUSED_KERNEL_DEVICES", (device_type,))
    return use


def _qkv(batch, heads_q, heads_kv, rows, kv_rows, head_dim, value_dim, dtype, device="cpu", seed=0):
    g = torch.Generator().manual_seed(seed)
    make = lambda *shape: torch.randn(*shape, generator=g).to(dtype).to(device)  # noqa: E731
    return (make(batch, heads_q, rows, head_dim), make(batch, heads_kv, kv_rows, head_dim),
            make(batch, heads_kv, kv_rows, value_dim))


@pytest.mark.parametrize("dtype, rows, kv_rows, head_dim, value_dim, causal, expected", [
    (torch.bfloat16, 48, 48, 64, 64, True, "flash"),        # square causal
    (torch.float16, 40, 72, 128, 128, False, "flash"),      # full, any shape
    (torch.bfloat16, 40, 72, 64, 64, True, "efficient"),    # non-square causal: flash's mask is bottom-right
    (torch.float32, 48, 48, 64, 64, True, "efficient"),     # fp32: flash takes half precision only
    (torch.bfloat16, 32, 32, 192, 128, False, "efficient"),  # latent attention: values narrower than keys
    (torch.bfloat16, 32, 32, 320, 320, False, "efficient"),  # head dim over flash's 256
    (torch.bfloat16, 32, 32, 12, 12, False, "reference"),   # neither kernel's alignment
    (torch.float64, 32, 32, 64, 64, True, "reference"),
])
def test_cuda_dispatch_and_the_calls_match_torchs_shape_functions(fused_on, dtype, rows, kv_rows, head_dim,
                                                                  value_dim, causal, expected):
    """The kernel chosen per block, and on ``meta`` tensors (torch's shape functions of the CUDA ops) every
    output's shape and dtype: out [B, Hq, S, Dv], LSE [B, Hq, S] fp32 contiguous, gradients like their
    inputs with GQA's K/V heads summed back."""
    q, k, v = _qkv(2, 8, 2, rows, kv_rows, head_dim, value_dim, dtype, device="meta")
    assert block_kernel(q, k, v, causal) == "reference"  # meta is not a fused device by default
    fused_on("meta")
    assert block_kernel(q, k, v, causal) == expected
    out, lse = block_attention_forward(q, k, v, causal, 0.125)
    assert out.shape == (2, 8, rows, value_dim) and out.dtype in (dtype, torch.float32)
    lse_dtype = torch.float64 if dtype == torch.float64 else torch.float32  # the reference's fp64 math
    assert lse.shape == (2, 8, rows) and lse.dtype == lse_dtype and lse.is_contiguous()
    grad_out = torch.empty(2, 8, rows, value_dim, dtype=dtype, device="meta")
    delta = torch.empty(2, 8, rows, dtype=torch.float32, device="meta")
    dq, dk, dv = block_attention_backward(grad_out, q, k, v, lse, delta, out.to(dtype), causal, 0.125)
    assert (dq.shape, dk.shape, dv.shape) == (q.shape, k.shape, v.shape)
    assert dq.dtype == dk.dtype == dv.dtype == dtype


def test_cuda_dispatch_is_off_on_cpu_and_under_reference_kernels(fused_on):
    q, k, v = _qkv(1, 2, 2, 8, 8, 16, 16, torch.bfloat16)
    assert block_kernel(q, k, v, True) == "cpu_flash"
    fused_on("cpu")
    assert block_kernel(q, k, v, True) == "flash"
    with blocks.reference_block_kernels():
        assert block_kernel(q, k, v, True) == "reference"


# ---- the CUDA ops emulated on CPU, with their own conventions -------------------------------------------------


def _emulated_scores(q, k, scale, causal, bottom_right):
    scores = (q.double() @ k.double().transpose(-1, -2)) * scale
    if causal:
        rows, cols = q.shape[2], k.shape[2]
        offset = cols - rows if bottom_right else 0
        keep = torch.arange(cols)[None, :] <= torch.arange(rows)[:, None] + offset
        scores = scores.masked_fill(~keep, float("-inf"))
    return scores


def _emulated_backward(grad_out, q, k, v, out, lse_rows, scale, causal, bottom_right):
    """What the fused backwards compute: delta from out and grad_out, probabilities from the given LSE."""
    probs = torch.exp(_emulated_scores(q, k, scale, causal, bottom_right) - lse_rows.double().unsqueeze(-1))
    delta = (out.double() * grad_out.double()).sum(-1, keepdim=True)
    dscores = probs * (grad_out.double() @ v.double().transpose(-1, -2) - delta)
    return ((dscores @ k.double()) * scale).to(q.dtype), ((dscores.transpose(-1, -2) @ q.double()) * scale).to(
        k.dtype), (probs.transpose(-1, -2) @ grad_out.double()).to(v.dtype)


def _check_same_heads(q, k, v):
    # neither CUDA kernel takes grouped heads: the glue must have repeated them
    assert q.shape[1] == k.shape[1] == v.shape[1] and q.dtype == k.dtype == v.dtype


class _EmulatedCudaOps:
    def __init__(self):
        self.calls = []

    def _scaled_dot_product_flash_attention(self, q, k, v, dropout_p, is_causal, return_debug_mask, *, scale):
        _check_same_heads(q, k, v)
        assert q.dtype in (torch.bfloat16, torch.float16) and dropout_p == 0.0 and not return_debug_mask
        self.calls.append("flash")
        scores = _emulated_scores(q, k, scale, is_causal, bottom_right=True)
        lse = torch.logsumexp(scores, -1)
        out = (torch.exp(scores - lse.unsqueeze(-1)) @ v.double()).to(q.dtype)
        seed = torch.zeros(2, dtype=torch.uint64)
        return (out, lse.float(), None, None, q.shape[2], k.shape[2], seed, torch.zeros((), dtype=torch.uint64),
                torch.empty(0, dtype=q.dtype))

    def _scaled_dot_product_flash_attention_backward(self, grad_out, q, k, v, out, lse, cum_q, cum_k, max_q,
                                                     max_k, dropout_p, is_causal, seed, offset, *, scale):
        _check_same_heads(q, k, v)
        assert lse.shape == q.shape[:3] and lse.dtype == torch.float32 and (max_q, max_k) == (q.shape[2],
                                                                                               k.shape[2])
        assert grad_out.dtype == out.dtype == q.dtype and cum_q is None and dropout_p == 0.0
        self.calls.append("flash_backward")
        return _emulated_backward(grad_out, q, k, v, out, lse, scale, is_causal, bottom_right=True)

    def _scaled_dot_product_efficient_attention(self, q, k, v, attn_bias, compute_log_sumexp, dropout_p,
                                                is_causal, *, scale):
        _check_same_heads(q, k, v)
        assert attn_bias is None and compute_log_sumexp and dropout_p == 0.0
        self.calls.append("efficient")
        scores = _emulated_scores(q, k, scale, is_causal, bottom_right=False)
        lse = torch.logsumexp(scores, -1)
        out = (torch.exp(scores - lse.unsqueeze(-1)) @ v.double()).to(q.dtype)
        rows = q.shape[2]
        padded = torch.full((*q.shape[:2], -(-rows // 32) * 32), float("nan"))
        padded[..., :rows] = lse.float()
        return out, padded, torch.zeros((), dtype=torch.int64), torch.zeros((), dtype=torch.int64)

    def _scaled_dot_product_efficient_attention_backward(self, grad_out, q, k, v, attn_bias, out, lse, seed,
                                                         offset, dropout_p, grad_input_mask, is_causal, *, scale):
        _check_same_heads(q, k, v)
        rows = q.shape[2]
        assert lse.shape[-1] % 32 == 0 and lse.shape[-1] >= rows and lse.is_contiguous()
        assert attn_bias is None and list(grad_input_mask) == [True, True, True, False]
        assert grad_out.dtype == out.dtype == q.dtype
        self.calls.append("efficient_backward")
        return (*_emulated_backward(grad_out, q, k, v, out, lse[..., :rows], scale, is_causal, bottom_right=False),
                None)

    def __getattr__(self, name):  # every other aten op (the CPU flash kernel is not used here)
        return getattr(torch.ops.aten, name)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows, kv_rows, causal, heads_kv", [
    (37, 37, True, 4),    # square causal: flash in half precision
    (23, 41, True, 2),    # non-square causal (top-left): never flash
    (29, 53, False, 1),   # full, MQA
])
def test_fused_glue_matches_the_reference_kernels(monkeypatch, fused_on, dtype, rows, kv_rows, causal, heads_kv):
    """Forward (out, LSE) and backward (with the real output rows, and with only delta: the stand-in output)
    through the emulated CUDA ops equal the plain-torch reference kernels within the block tolerance."""
    emulated = _EmulatedCudaOps()
    monkeypatch.setattr(blocks, "aten", emulated)
    fused_on("cpu")
    q, k, v = _qkv(2, 4, heads_kv, rows, kv_rows, 16, 16, dtype, seed=rows)
    scale = 16 ** -0.5
    expected_kernel = block_kernel(q, k, v, causal)
    assert expected_kernel == ("flash" if dtype == torch.bfloat16 and (rows == kv_rows or not causal)
                               else "efficient")

    out, lse = block_attention_forward(q, k, v, causal, scale)
    ref_out, ref_lse = reference_block_forward(q, k, v, causal, scale)
    tol = tolerance(dtype, "attention_block_grads")
    torch.testing.assert_close(out.float(), ref_out.float(), rtol=tol.rtol, atol=tol.atol)
    torch.testing.assert_close(lse, ref_lse, rtol=1e-5, atol=1e-5)
    assert not lse.isnan().any()

    g = torch.Generator().manual_seed(7)
    grad_out = torch.randn(out.shape, generator=g).to(dtype)
    delta = attention_delta(ref_out, grad_out)
    ref_grads = reference_block_backward(grad_out, q, k, v, ref_lse, delta, causal, scale)
    for given_out in (ref_out, None):  # the real output rows; only delta (a stand-in output)
        grads = block_attention_backward(grad_out, q, k, v, ref_lse, delta, given_out, causal, scale)
        for got, want in zip(grads, ref_grads):
            assert got.shape == want.shape and got.dtype == want.dtype and not got.isnan().any()
            torch.testing.assert_close(got.float(), want.float(), rtol=tol.rtol, atol=tol.atol)
    assert emulated.calls == [expected_kernel, expected_kernel + "_backward", expected_kernel + "_backward"]


def test_a_wrong_causal_alignment_would_be_caught(monkeypatch, fused_on):
    """The check above can fail: sending a non-square causal block to the flash kernel (bottom-right mask)
    gives other numbers than the reference's top-left mask."""
    emulated = _EmulatedCudaOps()
    monkeypatch.setattr(blocks, "aten", emulated)
    monkeypatch.setattr(blocks, "block_kernel", lambda *args: "flash")
    fused_on("cpu")
    q, k, v = _qkv(1, 2, 2, 23, 41, 16, 16, torch.bfloat16)
    out, _ = block_attention_forward(q, k, v, True, 0.25)
    ref_out, _ = reference_block_forward(q, k, v, True, 0.25)
    assert (out.float() - ref_out.float()).abs().max() > 0.1
