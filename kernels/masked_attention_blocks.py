"""The element-wise masked block kernels: blocks whose mask or score mods need global positions.

A :data:`burstc.block_geometry.POSITIONS` block (a sliding window's edge), and any block when the
spec has score mods (:class:`~burstc.attention_ir.Alibi`, :class:`~burstc.attention_ir.SoftCap`),
runs here: plain torch in fp32, chunked over query rows like the reference kernels of
:mod:`burstc.kernels.attention_blocks` (a smaller score budget, :data:`MASKED_SCORE_BUDGET_BYTES`), and each chunk only touches the key
columns its rows can see (binary search on the positions), so a narrow window costs its band, not
the block.  Scores, in order: ``s = scale * q k^T``; ALiBi ``s + slope_h * (j - i)``; soft-cap
``c * tanh(s / c)``; then hidden entries are ``-inf``.  Same contracts and LSE convention as the
kernels of :mod:`burstc.kernels.attention_blocks`; a row that sees nothing in the block gets
``lse = -inf`` and ``out = 0`` (the merge leaves such rows unchanged).

Runtime terms (:class:`~burstc.attention_ir.Documents`, :class:`~burstc.attention_ir.KeyPadding`)
read per-batch data indexed by *global* position: ``doc_ids_BS`` / ``key_valid_BS`` ``[B, S_global]``
(the whole sequence: every rank holds it), so the mask of an entry is ``static(i, j) & doc[b, i] ==
doc[b, j] & valid[b, j]`` and varies with the batch index.  The backward takes the global LSE; a row
whose global LSE is ``-inf`` (it sees nothing anywhere) gets zero gradients, not NaN.
"""
from __future__ import annotations

import functools
from typing import Iterator

import torch
from torch import Tensor

from burstc.attention_ir import Alibi, Documents, KeyPadding, MaskSpec, SoftCap
from burstc.block_geometry import visible_intervals
from burstc.kernels.attention_blocks import _reference_row_chunk, _repeat_kv_heads
from burstc.ops import host_reads
from burstc.ops.lse_merge import ACC_DTYPE, attention_delta


# fp32 score chunk budget of the masked kernels: a chunk's temporaries are several scores-sized tensors at once
# (TEMPORARY_CHUNKS), so a 256 MiB chunk (the reference kernels' budget) held 777 MiB in the forward and 1,048 MiB
# in the backward of a [4, 4, 2048, 2048] block; 32 MiB chunks held 105 / 181 MiB and ran 1.3-1.5x faster (fewer
# cache misses; benchmarks/masked_chunk_budget.py)
MASKED_SCORE_BUDGET_BYTES = 32 * 2**20


def _masked_row_chunk(batch: int, heads: int, kv_len: int) -> int:
    """Query rows per chunk: one fp32 ``[B, H, rows, kv_len]`` score chunk within the budget, at least 16 rows."""
    return _reference_row_chunk(batch, heads, kv_len, budget_bytes=MASKED_SCORE_BUDGET_BYTES)


def _chunks(q_pos: Tensor, kv_pos: Tensor, mask: MaskSpec, batch: int, heads: int) -> Iterator[tuple[slice, slice]]:
    """``(rows, cols)`` per chunk of query rows: cols spans every key the chunk's rows see; chunks
    that see nothing are skipped."""
    lo, hi = visible_intervals(q_pos, kv_pos, mask)
    seen = hi > lo
    chunk = _masked_row_chunk(batch, heads, kv_pos.numel())
    for start in range(0, q_pos.numel(), chunk):
        rows = slice(start, start + chunk)
        if bool(seen[rows].any()):
            yield rows, slice(int(lo[rows][seen[rows]].min()), int(hi[rows].max()))


# fp32 score-sized temporaries alive at once (measured, benchmarks/masked_chunk_budget.py): forward scores,
# (scores - lse), exp; backward scores, probs, (dO v^T - delta), dscores for a block of one chunk, and with more
# chunks the last chunk's scores, probs, dscores (alive until the loop rebinds them) beside the next chunk's two;
# a soft-cap keeps tanh and adds (1 - tanh^2)
TEMPORARY_CHUNKS = {"forward": 3, "backward": 5}
ONE_CHUNK_TEMPORARIES = {"forward": 3, "backward": 4}
SOFTCAP_TEMPORARY_CHUNKS = {"forward": 1, "backward": 2}


def temporary_bytes(op: str, batch: int, heads_q: int, q_rows: int, kv_rows: int, softcap: bool) -> int:
    """The fp32 score-sized temporaries :func:`masked_block_forward` (``op`` "forward") or
    :func:`masked_block_backward` holds at once on a ``q_rows`` x ``kv_rows`` block: chunks of at most the
    masked kernels' score budget (at least 16 rows, :func:`_chunks`)."""
    rows = _masked_row_chunk(batch, heads_q, kv_rows)
    count = (TEMPORARY_CHUNKS if rows < q_rows else ONE_CHUNK_TEMPORARIES)[op]
    count += SOFTCAP_TEMPORARY_CHUNKS[op] if softcap else 0
    return count * batch * heads_q * min(q_rows, rows) * kv_rows * 4


def visible_entries(q_pos: Tensor, kv_pos: Tensor, mask: MaskSpec, doc_ids_BS: Tensor | None = None,
                    key_valid_BS: Tensor | None = None) -> Tensor:
    """Bool ``[Sq, Skv]``, or ``[B, Sq, Skv]`` with runtime terms: which entries of the block are
    visible (``doc_ids_BS`` / ``key_valid_BS`` are indexed by global position)."""
    docs = {}
    if mask.term(Documents) is not None:
        docs = {"q_docs": doc_ids_BS[:, q_pos], "kv_docs": doc_ids_BS[:, kv_pos]}
    valid = key_valid_BS[:, kv_pos] if mask.term(KeyPadding) is not None else None
    return mask.visible(q_pos, kv_pos, **docs, kv_valid=valid)


@functools.lru_cache(maxsize=64)
def _slopes(slopes: tuple[float, ...], dtype: torch.dtype, device: torch.device) -> Tensor:
    """ALiBi's slopes on the device, copied once (a copy per chunk would also wait for the device each time)."""
    return host_reads.to_device(torch.tensor(slopes, dtype=dtype), device)


def _scores(q_chunk: Tensor, k_cols: Tensor, q_pos: Tensor, kv_pos: Tensor, mask: MaskSpec, scale: float,
            doc_ids_BS: Tensor | None, key_valid_BS: Tensor | None) -> tuple[Tensor, Tensor | None]:
    """Modded scores (``-inf`` where hidden) of a chunk and, with soft-cap, ``tanh(s / c)`` for the backward."""
    scores = (q_chunk @ k_cols.transpose(-1, -2)) * scale
    alibi, softcap = mask.term(Alibi), mask.term(SoftCap)
    if alibi is not None:
        if len(alibi.slopes) != q_chunk.shape[1]:
            raise ValueError(f"ALiBi has {len(alibi.slopes)} slopes for {q_chunk.shape[1]} query heads")
        slopes_H11 = _slopes(alibi.slopes, scores.dtype, scores.device).view(1, -1, 1, 1)
        scores = scores + slopes_H11 * (kv_pos[None, :] - q_pos[:, None]).to(scores.dtype)
    tanh = None
    if softcap is not None:
        tanh = torch.tanh(scores / softcap.cap)
        scores = softcap.cap * tanh
    visible = visible_entries(q_pos, kv_pos, mask, doc_ids_BS, key_valid_BS)
    if visible.dim() == 3:  # per batch row: broadcast over heads
        visible = visible.unsqueeze(1)
    return scores.masked_fill(~visible, float("-inf")), tanh


def masked_block_forward(q_BHSD: Tensor, k_BHSD: Tensor, v_BHSD: Tensor, q_pos: Tensor, kv_pos: Tensor,
                         mask: MaskSpec, scale: float, doc_ids_BS: Tensor | None = None,
                         key_valid_BS: Tensor | None = None, chunk_positions: tuple[Tensor, Tensor] | None = None
                         ) -> tuple[Tensor, Tensor]:
    """``(out fp32, lse_BHS fp32)`` of one block with queries/keys at global positions ``q_pos``/``kv_pos``.
    ``chunk_positions``: the same positions on the host, where the chunks are chosen (default: ``q_pos``, ``kv_pos``;
    on a GPU pass host ones, or every chunk's choice waits for the device)."""
    batch, heads_q, q_len, head_dim = q_BHSD.shape
    acc = torch.promote_types(q_BHSD.dtype, ACC_DTYPE)
    groups = heads_q // k_BHSD.shape[1]
    k32, v32 = _repeat_kv_heads(k_BHSD, groups).to(acc), _repeat_kv_heads(v_BHSD, groups).to(acc)
    out = torch.zeros(batch, heads_q, q_len, head_dim, dtype=acc, device=q_BHSD.device)
    lse = torch.full((batch, heads_q, q_len), float("-inf"), dtype=acc, device=q_BHSD.device)
    for rows, cols in _chunks(*(chunk_positions or (q_pos, kv_pos)), mask, batch, heads_q):
        scores, _ = _scores(q_BHSD[:, :, rows].to(acc), k32[:, :, cols], q_pos[rows], kv_pos[cols], mask, scale,
                            doc_ids_BS, key_valid_BS)
        lse_chunk = torch.logsumexp(scores, -1)
        finite = torch.where(torch.isfinite(lse_chunk), lse_chunk, torch.zeros_like(lse_chunk))  # hidden rows: 0
        out[:, :, rows] = torch.exp(scores - finite.unsqueeze(-1)) @ v32[:, :, cols]
        lse[:, :, rows] = lse_chunk
    return out, lse.contiguous()


def masked_block_backward(grad_out_BHSD: Tensor, q_BHSD: Tensor, k_BHSD: Tensor, v_BHSD: Tensor, lse_BHS: Tensor,
                          delta_BHS: Tensor | None, out_BHSD: Tensor | None, q_pos: Tensor, kv_pos: Tensor,
                          mask: MaskSpec, scale: float, doc_ids_BS: Tensor | None = None,
                          key_valid_BS: Tensor | None = None, chunk_positions: tuple[Tensor, Tensor] | None = None
                          ) -> tuple[Tensor, Tensor, Tensor]:
    """``(dq, dk, dv)`` of one block given the *global* row statistics ``lse`` and ``delta``
    (or ``out``, from which delta is computed), in the inputs' dtypes (``chunk_positions``: as in
    :func:`masked_block_forward`)."""
    batch, heads_q, _, head_dim = q_BHSD.shape
    heads_kv, kv_len = k_BHSD.shape[1], k_BHSD.shape[2]
    groups = heads_q // heads_kv
    if delta_BHS is None:
        delta_BHS = attention_delta(out_BHSD, grad_out_BHSD)
    acc = torch.promote_types(q_BHSD.dtype, ACC_DTYPE)
    k32, v32 = _repeat_kv_heads(k_BHSD, groups).to(acc), _repeat_kv_heads(v_BHSD, groups).to(acc)
    dq32 = torch.zeros(q_BHSD.shape, dtype=acc, device=q_BHSD.device)
    dk32 = torch.zeros(batch, heads_q, kv_len, head_dim, dtype=acc, device=q_BHSD.device)
    dv32 = torch.zeros_like(dk32)
    for rows, cols in _chunks(*(chunk_positions or (q_pos, kv_pos)), mask, batch, heads_q):
        q32, do32 = q_BHSD[:, :, rows].to(acc), grad_out_BHSD[:, :, rows].to(acc)
        scores, tanh = _scores(q32, k32[:, :, cols], q_pos[rows], kv_pos[cols], mask, scale, doc_ids_BS, key_valid_BS)
        lse_rows = lse_BHS[:, :, rows].to(acc)
        # a row that sees nothing anywhere (lse -inf) has only -inf scores: probabilities 0, not NaN
        lse_rows = torch.where(lse_rows == float("-inf"), torch.zeros_like(lse_rows), lse_rows)
        probs = torch.exp(scores - lse_rows.unsqueeze(-1))
        dv32[:, :, cols] += probs.transpose(-1, -2) @ do32
        dscores = probs * (do32 @ v32[:, :, cols].transpose(-1, -2) - delta_BHS[:, :, rows].to(acc).unsqueeze(-1))
        if tanh is not None:  # d(c * tanh(x / c)) / dx = 1 - tanh^2; ALiBi's bias has no gradient
            dscores = dscores * (1 - tanh * tanh)
        dq32[:, :, rows] = (dscores @ k32[:, :, cols]) * scale
        dk32[:, :, cols] += (dscores.transpose(-1, -2) @ q32) * scale
    fold = lambda t: t.view(batch, heads_kv, groups, kv_len, head_dim).sum(2)  # noqa: E731
    return dq32.to(q_BHSD.dtype), fold(dk32).to(k_BHSD.dtype), fold(dv32).to(v_BHSD.dtype)
