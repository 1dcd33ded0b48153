"""Attention block kernels for the ring: one block of queries against one block of keys/values.

Two implementations side by side, with the same contract (the dispatch point for device kernels,
e.g. a later Triton kernel):

* the CPU flash kernels (``aten._scaled_dot_product_flash_attention_for_cpu`` and its backward),
  used on CPU;
* plain-torch reference kernels (chunked over query rows, fp32 math), used on every other device,
  and everywhere inside :func:`reference_block_kernels`.

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


def _use_cpu_flash(q: Tensor) -> bool:
    return q.device.type == "cpu" and not _force_reference_kernels


def block_attention_forward(q_BHSD: Tensor, k_BHSD: Tensor, v_BHSD: Tensor, causal: bool, scale: float
                            ) -> tuple[Tensor, Tensor]:
    """Attention of one block: ``(out, lse_BHS fp32 contiguous)``, out in q.dtype or fp32 (see
    below; the caller merges in fp32 either way).  Hkv may divide Hq; ``causal`` is top-left."""
    if _use_cpu_flash(q_BHSD):
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
                             causal: bool, scale: float) -> tuple[Tensor, Tensor, Tensor]:
    """Gradients of one block given the *global* softmax statistics of its query rows.

    ``lse_BHS`` and ``delta_BHS = rowsum(out * grad_out)`` (fp32) are those of the full attention
    row, so per-block results add up to the exact gradients.  Pass ``out_BHSD`` (the global output
    rows) or ``delta_BHS``, or both (then they must agree).  On CPU the flash kernel runs (with a
    stand-in output when only delta is given); the plain-torch kernel otherwise, and on CPU when
    no stand-in exists (see :func:`burstc.ops.lse_merge.stand_in_output`).
    """
    if _use_cpu_flash(q_BHSD):
        if out_BHSD is None:
            out_BHSD = stand_in_output(grad_out_BHSD, delta_BHS)
        if out_BHSD is not None:
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


def _reference_row_chunk(batch: int, heads: int, kv_len: int) -> int:
    return max(_REFERENCE_MIN_ROWS, _REFERENCE_SCORE_BUDGET_BYTES // max(1, batch * heads * kv_len * 4))


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
