"""Attention block kernels for the ring: one block of queries against one block of keys/values.

Three implementations with one contract, chosen per block by :func:`block_kernel`:

* ``cpu_flash``: the CPU flash kernels (``aten._scaled_dot_product_flash_attention_for_cpu`` and its
  backward), on CPU;
* ``flash`` / ``efficient``: torch's fused CUDA kernels that return the LSE, as torch's own context
  parallelism drives them (``aten._scaled_dot_product_flash_attention`` for bf16/fp16 with head dims
  that are multiples of 8 up to 256 and square causal blocks; else the memory-efficient kernel,
  ``aten._scaled_dot_product_efficient_attention``, which takes fp32, unequal value widths and top-left
  causal blocks of any shape).  Neither takes grouped K/V heads: those are repeated for the block
  (a local copy of the block's K/V, never sent) and their gradients summed back;
* ``reference``: plain-torch kernels (chunked over query rows, fp32 math), for every other case
  (fp64, other devices, head dims the fused kernels refuse) and everywhere inside
  :func:`reference_block_kernels`.

A block is full or top-left causal (``causal``); Hkv may divide Hq (query head h uses kv head
h // (Hq / Hkv), as ``enable_gqa`` does).  LSE convention: see :mod:`burstc.ops.lse_merge`.
"""
from __future__ import annotations

import contextlib
from typing import Iterator

import torch
from torch import Tensor

from burstc.ops.lse_merge import ACC_DTYPE, attention_delta, lse_to_BHS, stand_in_output

aten = torch.ops.aten

_force_reference_kernels = False


@contextlib.contextmanager
def reference_block_kernels() -> Iterator[None]:
    """Use the plain-torch block kernels on every device (they are what non-CPU devices use)."""
    global _force_reference_kernels
    previous, _force_reference_kernels = _force_reference_kernels, True
    try:
        yield
    finally:
        _force_reference_kernels = previous


# device types whose blocks run torch's fused kernels (tests add "meta", to check the calls against torch's
# shape functions, or "cpu" with the ops emulated, to check the glue's numbers)
FUSED_KERNEL_DEVICES: tuple[str, ...] = ("cuda",)
_FUSED_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
# the memory-efficient kernel's LSE rows come padded to a multiple of this (its backward reads them so)
_EFFICIENT_LSE_ROWS = 32


def block_kernel(q_BHSD: Tensor, k_BHSD: Tensor, v_BHSD: Tensor, causal: bool) -> str:
    """Which kernel computes this block: ``"cpu_flash"``, ``"flash"``, ``"efficient"`` or ``"reference"``."""
    if _force_reference_kernels:
        return "reference"
    if q_BHSD.device.type in FUSED_KERNEL_DEVICES:
        head_dim, value_dim = q_BHSD.shape[-1], v_BHSD.shape[-1]
        if q_BHSD.dtype not in _FUSED_DTYPES:
            return "reference"
        square = q_BHSD.shape[2] == k_BHSD.shape[2]
        if (q_BHSD.dtype != torch.float32 and head_dim == value_dim and head_dim % 8 == 0 and head_dim <= 256
                and (square or not causal)):
            # the flash kernel's causal mask is bottom-right on a non-square block: only square ones take it
            return "flash"
        alignment = 4 if q_BHSD.dtype == torch.float32 else 8
        if head_dim % alignment == 0 and value_dim % alignment == 0:
            return "efficient"
        return "reference"
    if q_BHSD.device.type == "cpu":
        return "cpu_flash"
    return "reference"


def _repeated_kv(q_BHSD: Tensor, k_BHSD: Tensor, v_BHSD: Tensor) -> tuple[Tensor, Tensor, int]:
    groups = q_BHSD.shape[1] // k_BHSD.shape[1]
    return _repeat_kv_heads(k_BHSD, groups), _repeat_kv_heads(v_BHSD, groups), groups


def _sum_kv_heads(grad_BHSD: Tensor, groups: int) -> Tensor:
    if groups == 1:
        return grad_BHSD
    batch, heads, rows, dim = grad_BHSD.shape
    return grad_BHSD.view(batch, heads // groups, groups, rows, dim).sum(2)


def _fused_forward(kernel: str, q_BHSD: Tensor, k_BHSD: Tensor, v_BHSD: Tensor, causal: bool, scale: float
                   ) -> tuple[Tensor, Tensor]:
    k_rep, v_rep, _ = _repeated_kv(q_BHSD, k_BHSD, v_BHSD)
    if kernel == "flash":
        out, lse = aten._scaled_dot_product_flash_attention(q_BHSD, k_rep, v_rep, 0.0, causal, False,
                                                            scale=scale)[:2]
    else:
        out, lse = aten._scaled_dot_product_efficient_attention(q_BHSD, k_rep, v_rep, None, True, 0.0, causal,
                                                                scale=scale)[:2]
    # both LSEs are the natural log of the scaled scores' exp-sum in fp32 (burstc's convention); the
    # efficient kernel pads its rows
    return out, lse[:, :, :q_BHSD.shape[2]].to(ACC_DTYPE).contiguous()


def _fused_backward(kernel: str, grad_out_BHSD: Tensor, q_BHSD: Tensor, k_BHSD: Tensor, v_BHSD: Tensor,
                    out_BHSD: Tensor, lse_BHS: Tensor, causal: bool, scale: float) -> tuple[Tensor, Tensor, Tensor]:
    k_rep, v_rep, groups = _repeated_kv(q_BHSD, k_BHSD, v_BHSD)
    # the kernels take one dtype for q, k, v, out and grad_out; delta = rowsum(out * grad_out) is all they
    # read of out (a stand-in is rounded like any output, as on CPU)
    grad_out_BHSD, out_BHSD = grad_out_BHSD.to(q_BHSD.dtype), out_BHSD.to(q_BHSD.dtype)
    rows, kv_rows, device = q_BHSD.shape[2], k_BHSD.shape[2], q_BHSD.device
    lse_BHS = lse_BHS.to(ACC_DTYPE)
    if kernel == "flash":
        # dropout 0: the RNG state is not read
        rng_state, unused = torch.empty(2, dtype=torch.uint64, device=device), torch.empty((), dtype=torch.uint64,
                                                                                            device=device)
        dq, dk, dv = aten._scaled_dot_product_flash_attention_backward(
            grad_out_BHSD, q_BHSD, k_rep, v_rep, out_BHSD, lse_BHS.contiguous(), None, None, rows, kv_rows, 0.0,
            causal, rng_state, unused, scale=scale)
    else:
        padded = -(-rows // _EFFICIENT_LSE_ROWS) * _EFFICIENT_LSE_ROWS
        lse_padded = torch.nn.functional.pad(lse_BHS, (0, padded - rows)).contiguous()
        seed, offset = (torch.empty((), dtype=torch.int64, device=device) for _ in range(2))
        dq, dk, dv = aten._scaled_dot_product_efficient_attention_backward(
            grad_out_BHSD, q_BHSD, k_rep, v_rep, None, out_BHSD, lse_padded, seed, offset, 0.0,
            [True, True, True, False], causal, scale=scale)[:3]
    return dq, _sum_kv_heads(dk, groups), _sum_kv_heads(dv, groups)


def block_attention_forward(q_BHSD: Tensor, k_BHSD: Tensor, v_BHSD: Tensor, causal: bool, scale: float
                            ) -> tuple[Tensor, Tensor]:
    """Attention of one block: ``(out, lse_BHS fp32 contiguous)``, out in q.dtype or fp32 (see
    below; the caller merges in fp32 either way).  Hkv may divide Hq; ``causal`` is top-left."""
    kernel = block_kernel(q_BHSD, k_BHSD, v_BHSD, causal)
    if kernel in ("flash", "efficient"):
        return _fused_forward(kernel, q_BHSD, k_BHSD, v_BHSD, causal, scale)
    if kernel == "cpu_flash":
        # The CPU flash forward runs as fast in fp32 as in bf16 (measured, 8K x 4K blocks), so
        # low-precision blocks are computed in fp32: the merge then sees unrounded block outputs.
        # (Its backward is ~25% faster in bf16, so the backward keeps the input dtype.)
        if q_BHSD.dtype in (torch.bfloat16, torch.float16):
            q_BHSD, k_BHSD, v_BHSD = (t.to(ACC_DTYPE) for t in (q_BHSD, k_BHSD, v_BHSD))
        out, lse = aten._scaled_dot_product_flash_attention_for_cpu(
            q_BHSD, k_BHSD, v_BHSD, 0.0, causal, scale=scale)
        return out, lse_to_BHS(lse)
    return reference_block_forward(q_BHSD, k_BHSD, v_BHSD, causal, scale)


def block_attention_backward(grad_out_BHSD: Tensor, q_BHSD: Tensor, k_BHSD: Tensor, v_BHSD: Tensor,
                             lse_BHS: Tensor, delta_BHS: Tensor | None, out_BHSD: Tensor | None,
                             causal: bool, scale: float, delta_has_lse_grad: bool = True
                             ) -> tuple[Tensor, Tensor, Tensor]:
    """Gradients of one block given the *global* softmax statistics of its query rows.

    ``lse_BHS`` and ``delta_BHS = rowsum(out * grad_out)`` (fp32) are those of the full attention
    row, so per-block results add up to the exact gradients.  Pass ``out_BHSD`` (the global output
    rows) or ``delta_BHS``, or both (then they must agree).  The CPU flash and the fused CUDA kernels
    run with a stand-in output when only delta is given; the plain-torch kernel when no stand-in
    exists (see :func:`burstc.ops.lse_merge.stand_in_output`; ``delta_has_lse_grad`` False: delta is
    ``rowsum(out * grad_out)`` exactly, so one does) and where :func:`block_kernel` says so.
    """
    kernel = block_kernel(q_BHSD, k_BHSD, v_BHSD, causal)
    if kernel != "reference":
        if out_BHSD is None:
            out_BHSD = stand_in_output(grad_out_BHSD, delta_BHS, delta_has_lse_grad)
        if out_BHSD is not None:
            if kernel != "cpu_flash":
                return _fused_backward(kernel, grad_out_BHSD, q_BHSD, k_BHSD, v_BHSD, out_BHSD, lse_BHS, causal,
                                       scale)
            return aten._scaled_dot_product_flash_attention_for_cpu_backward(
                grad_out_BHSD, q_BHSD, k_BHSD, v_BHSD, out_BHSD, lse_BHS, 0.0, causal, scale=scale)
    if delta_BHS is None:
        delta_BHS = attention_delta(out_BHSD, grad_out_BHSD)
    return reference_block_backward(grad_out_BHSD, q_BHSD, k_BHSD, v_BHSD, lse_BHS, delta_BHS, causal, scale)


# The plain-torch block kernels hold a few [B, Hq, rows, S_kv] fp32 score-sized buffers per chunk of query
# rows (scores, probabilities, their gradient): rows are chosen so one such buffer stays under this budget,
# e.g. B=1, Hq=32, S_kv=32K -> 64 rows (256 MiB); never fewer than 16 rows.
_REFERENCE_SCORE_BUDGET_BYTES = 256 * 2**20
_REFERENCE_MIN_ROWS = 16


def _reference_row_chunk(batch: int, heads: int, kv_len: int, budget_bytes: int | None = None) -> int:
    """Query rows per chunk: one fp32 ``[B, H, rows, kv_len]`` buffer within ``budget_bytes`` (the reference
    kernels' budget by default, read at call time), never fewer than 16 rows."""
    budget = _REFERENCE_SCORE_BUDGET_BYTES if budget_bytes is None else budget_bytes
    return max(_REFERENCE_MIN_ROWS, budget // max(1, batch * heads * kv_len * 4))


def _repeat_kv_heads(t_BHSD: Tensor, groups: int) -> Tensor:
    # Local only (never sent): query head h uses kv head h // groups, as enable_gqa does.
    return t_BHSD if groups == 1 else t_BHSD.repeat_interleave(groups, dim=1)


def _causal_mask(row_start: int, rows: int, cols: int, device) -> Tensor:
    row_ids = torch.arange(row_start, row_start + rows, device=device)[:, None]
    return torch.arange(cols, device=device)[None, :] <= row_ids  # top-left aligned


def _masked_scores(q_chunk: Tensor, k_BHSD: Tensor, scale: float, causal: bool, row_start: int) -> Tensor:
    """Scaled scores of a chunk of query rows (starting at block row ``row_start``), -inf where masked."""
    scores = (q_chunk @ k_BHSD.transpose(-1, -2)) * scale
    if causal:
        keep = _causal_mask(row_start, q_chunk.shape[2], k_BHSD.shape[2], q_chunk.device)
        scores = scores.masked_fill(~keep, float("-inf"))
    return scores


def reference_block_forward(q_BHSD: Tensor, k_BHSD: Tensor, v_BHSD: Tensor, causal: bool, scale: float
                            ) -> tuple[Tensor, Tensor]:
    """Plain-torch :func:`block_attention_forward`: fp32 math (fp64 for fp64 inputs), chunked over rows."""
    groups = q_BHSD.shape[1] // k_BHSD.shape[1]
    acc = torch.promote_types(q_BHSD.dtype, ACC_DTYPE)
    k32, v32 = _repeat_kv_heads(k_BHSD, groups).to(acc), _repeat_kv_heads(v_BHSD, groups).to(acc)
    outs, lses = [], []
    chunk = _reference_row_chunk(q_BHSD.shape[0], q_BHSD.shape[1], k_BHSD.shape[2])
    for start in range(0, q_BHSD.shape[2], chunk):
        scores = _masked_scores(q_BHSD[:, :, start:start + chunk].to(acc), k32, scale, causal, start)
        lse = torch.logsumexp(scores, -1)
        outs.append(torch.exp(scores - lse.unsqueeze(-1)) @ v32)
        lses.append(lse)
    return torch.cat(outs, 2).to(q_BHSD.dtype), torch.cat(lses, 2).contiguous()


def reference_block_backward(grad_out_BHSD: Tensor, q_BHSD: Tensor, k_BHSD: Tensor, v_BHSD: Tensor,
                             lse_BHS: Tensor, delta_BHS: Tensor, causal: bool, scale: float
                             ) -> tuple[Tensor, Tensor, Tensor]:
    """Plain-torch :func:`block_attention_backward` with the global row statistics ``lse`` and ``delta``."""
    batch, heads_q, _, head_dim = q_BHSD.shape
    heads_kv, kv_len = k_BHSD.shape[1], k_BHSD.shape[2]
    groups = heads_q // heads_kv
    acc = torch.promote_types(q_BHSD.dtype, ACC_DTYPE)
    k32, v32 = _repeat_kv_heads(k_BHSD, groups).to(acc), _repeat_kv_heads(v_BHSD, groups).to(acc)
    dq_chunks = []
    dk32 = torch.zeros(batch, heads_q, kv_len, head_dim, dtype=acc, device=q_BHSD.device)
    dv32 = torch.zeros_like(dk32)
    chunk = _reference_row_chunk(batch, heads_q, kv_len)
    for start in range(0, q_BHSD.shape[2], chunk):
        rows = slice(start, start + chunk)
        q32, do32 = q_BHSD[:, :, rows].to(acc), grad_out_BHSD[:, :, rows].to(acc)
        scores = _masked_scores(q32, k32, scale, causal, start)
        probs = torch.exp(scores - lse_BHS[:, :, rows].unsqueeze(-1))
        dv32 += probs.transpose(-1, -2) @ do32
        # d(scores) = P * (dP - delta): softmax backward with the global row statistic delta
        dscores = probs * (do32 @ v32.transpose(-1, -2) - delta_BHS[:, :, rows].unsqueeze(-1))
        dq_chunks.append((dscores @ k32) * scale)
        dk32 += (dscores.transpose(-1, -2) @ q32) * scale
    fold = lambda t: t.view(batch, heads_kv, groups, kv_len, head_dim).sum(2)  # noqa: E731
    return torch.cat(dq_chunks, 2).to(q_BHSD.dtype), fold(dk32).to(k_BHSD.dtype), fold(dv32).to(v_BHSD.dtype)
