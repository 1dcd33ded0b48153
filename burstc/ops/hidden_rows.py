"""Eager's answer for a query row whose every key is hidden: the uniform average over all keys.

A model that hides scores by adding (or ``masked_fill``-ing) a huge finite number — HF's eager attention adds
``finfo.min`` — gives a query row whose every key is hidden (left padding: the pad positions before a row's first
real token) ``s + fill == fill`` for every key: the score is lost to rounding and the softmax is exactly uniform,
so the row's output is the mean of V over all ``n`` keys.  Autograd still differentiates through the addition, so
eager's gradients are those of a uniform softmax (``P_ij = 1/n``, ``D_i = dO_i . out_i``):

    out_i = vbar = vsum / n                                   vsum = sum_j v_j
    dq_i  = scale/n * (dO_i @ M - (dO_i . vbar) ksum)         M = sum_j v_j k_j^T,  ksum = sum_j k_j
    dk_j += scale/n * N (v_j - vbar)                          N = sum_i q_i dO_i^T (hidden rows i)
    dv_j += dosum / n                                         dosum = sum_i dO_i (hidden rows i)

per batch row and KV head (a GQA group's query heads summed into its KV head), j over every key.  The ring op
computes the other rows and gives hidden rows out 0 and no gradient; these functions add the hidden rows' share.
Every sum is at most ``[B, Hkv, D, D]``, so one all-reduce over the sequence group gives each rank the whole
sequence's — no ring, no ``[S, S]`` — and only for calls whose data hide a row (decided from the replicated
mask data, identically on every rank: every rank joins the all-reduce or none does).

A model that *replaces* hidden scores (``scores.masked_fill(hidden, fill)``) gets the same uniform output for any
finite fill, but no gradient reaches q and k through the replaced scores: only the dv share applies.

Exact only where ``s + fill == fill`` for every score: the caller checks the fill (finite, ``<= -1e30``:
``AttentionMatch.hidden_rows``).  ALiBi's bias is a constant: it leaves the gradients above unchanged.

A soft-cap (Gemma-2: ``c * tanh(r / c)`` on the scaled scores ``r``, before the fill is added) bends the score
gradient per entry, ``dr_ij = dS_ij (1 - tanh^2(r_ij / c))`` with ``dS_ij = (dO_i . v_j - dO_i . vbar) / n``: not
low-rank, so the sums above can't carry it.  Then every rank gets every hidden row's ``(q_i, dO_i)`` (one
all-reduce of ``[B, H, N, D]`` slots, ``N`` the most hidden rows of a batch row: padding-sized, not ``[S, S]``),
computes their entries against its own keys in chunks (its ``dk`` share directly; a partial ``dq`` of every slot),
and one more all-reduce sums the ``dq`` slots, of which each rank keeps its own rows.
"""
from __future__ import annotations

import torch
import torch.distributed as dist
from torch import Tensor

from typing import NamedTuple

from burstc.attention_ir import Alibi, MaskSpec, SoftCap, document_ids_for_batch, fully_hidden_rows
from burstc.errors import wait_for_peer
from burstc.layout import local_positions
from burstc.ops import host_reads
from burstc.ops.lse_merge import ACC_DTYPE
from burstc.ops.ring_comm import Ring


class HiddenRows(NamedTuple):
    """This rank's view of a call's hidden rows, on the op's device.  Decided on the host from the host copy of the
    mask data (:mod:`burstc.ops.host_reads`), with every index the functions below select by (a boolean mask or
    ``nonzero`` on a GPU tensor would wait for the GPU)."""

    hidden_BL: Tensor     # bool: this rank's query rows that see no key, in local order
    real_L: Tensor        # bool: this rank's rows that are real keys (global position < keys: not a layout pad)
    hidden_BS: Tensor     # bool ``[B, keys]``: every rank's hidden rows, by global position
    positions_L: Tensor   # int64: the global position of each local row
    real_index_R: Tensor  # int64: the local indices of the real rows
    slots: int            # the most hidden rows of one batch row (the soft-cap path's slots)
    own_B: Tensor         # int64, one per hidden row of this rank: its batch row,
    own_L: Tensor         # its local row,
    own_slot: Tensor      # and its slot (its rank among its batch row's hidden rows)
    all_B: Tensor         # int64, one per hidden row of any rank: its batch row,
    all_S: Tensor         # its global position,
    all_slot: Tensor      # and its slot


def local_hidden_rows(mask: MaskSpec, doc_ids: Tensor | None, key_valid: Tensor | None, keys: int, layout: str,
                      rank: int, size: int, local_len: int, device) -> HiddenRows | None:
    """This rank's :class:`HiddenRows` of the call, on ``device``, decided from ``doc_ids`` / ``key_valid`` (pass
    their host copies: they are read here); None when no row of the call (on any rank) is hidden."""
    docs = None if doc_ids is None else document_ids_for_batch(doc_ids, doc_ids.shape[0])
    hidden_BS = fully_hidden_rows(mask, doc_ids_BS=docs, key_valid_BS=key_valid)
    if hidden_BS is None:
        return None
    hidden_BS = hidden_BS[:, :keys]  # a layout pad's own row is not the model's
    if not bool(hidden_BS.any()):
        return None
    positions = local_positions(local_len * size, size, rank, layout, device=hidden_BS.device)
    real_L = positions < keys
    hidden_BL = torch.zeros(hidden_BS.shape[0], local_len, dtype=torch.bool, device=hidden_BS.device)
    hidden_BL[:, real_L] = hidden_BS[:, positions[real_L]]
    slot_BS = hidden_BS.to(torch.int64).cumsum(1) - 1
    own_B, own_L = hidden_BL.nonzero(as_tuple=True)
    all_B, all_S = hidden_BS.nonzero(as_tuple=True)
    def move(t: Tensor) -> Tensor:
        return host_reads.to_device(t, device)

    return HiddenRows(*map(move, (hidden_BL, real_L, hidden_BS, positions, real_L.nonzero().squeeze(1))),
                      int(hidden_BS.sum(1).max()),
                      *map(move, (own_B, own_L, slot_BS[own_B, positions[own_L]], all_B, all_S,
                                  slot_BS[all_B, all_S])))


def _group_sum(x_BH: Tensor, kv_heads: int) -> Tensor:
    """Sum a GQA group's query heads (dim 1) into its KV head."""
    return x_BH.unflatten(1, (kv_heads, -1)).sum(2)


def _per_query_head(x_BK: Tensor, heads_q: int) -> Tensor:
    return x_BK.repeat_interleave(heads_q // x_BK.shape[1], dim=1)


def all_reduce_sequence(tensor: Tensor, ring, what: str) -> Tensor:
    """Sum ``tensor`` in place over every rank of the sequence-parallel ``ring`` (a flat ring's group, or a
    node's ranks then the lanes across nodes), each wait bounded by the ring's timeout."""
    if isinstance(ring, Ring):
        rings = [ring]
    else:  # TwoLevelRing (two Rings) or UlyssesRing (its intra-node all-to-all group, an inter-node Ring)
        rings = [ring.intra if isinstance(ring.intra, Ring) else Ring(ring.intra), ring.inter]
    for part in rings:
        wait_for_peer(dist.all_reduce(tensor, group=part.group, async_op=True), part.timeout_s,
                      f"burstc {what}: rank {dist.get_rank()} waited for the other ranks of its sequence group",
                      "Every rank of the mesh must call the compiled model, with the same batch")
    return tensor


def add_uniform_rows_(out_BHLD: Tensor, v_BKLD: Tensor, rows: HiddenRows, keys: int, ring) -> None:
    """Forward: give the hidden rows of ``out`` (the ring op's zeros) the mean of V over all ``keys`` keys."""
    hidden_BL = rows.hidden_BL
    vsum_BKD = v_BKLD.index_select(2, rows.real_index_R).to(ACC_DTYPE).sum(2)
    all_reduce_sequence(vsum_BKD, ring, "uniform hidden rows (forward)")
    vbar_BHD = _per_query_head(vsum_BKD / keys, out_BHLD.shape[1]).to(out_BHLD.dtype)
    where_BHLD = hidden_BL[:, None, :, None].expand_as(out_BHLD)
    out_BHLD.copy_(torch.where(where_BHLD, vbar_BHD[:, :, None, :].expand_as(out_BHLD), out_BHLD))


def uniform_rows_grads(grad_out_BHLD: Tensor, q_BHLD: Tensor, k_BKLD: Tensor, v_BKLD: Tensor, rows: HiddenRows,
                       keys: int, scale: float, ring, score_grad: bool = True, mask: MaskSpec | None = None
                       ) -> tuple[Tensor | None, Tensor | None, Tensor]:
    """Backward: the hidden rows' share of ``(dq, dk, dv)`` (fp32, to add to the ring op's), by the formulas
    above; one all-reduce of ``[M, ksum, vsum, N, dosum]``.  ``score_grad=False``: the model replaced the hidden
    scores (``masked_fill``) instead of adding to them, so no gradient reaches q and k through them: dv only
    (dq and dk shares None).  A soft-cap in ``mask``: the per-entry path, :func:`_soft_capped_score_grads`."""
    hidden_BL, real_L = rows.hidden_BL, rows.real_L
    kv_heads, heads_q = k_BKLD.shape[1], q_BHLD.shape[1]
    softcap = None if mask is None or not score_grad else mask.term(SoftCap)
    real = real_L.to(ACC_DTYPE)[None, None, :, None]
    do_BHLD = grad_out_BHLD.to(ACC_DTYPE) * hidden_BL[:, None, :, None].to(ACC_DTYPE)
    if score_grad:  # (a replaced score's rows need only dO's sum)
        k32, v32 = k_BKLD.to(ACC_DTYPE) * real, v_BKLD.to(ACC_DTYPE) * real
    sums = [_group_sum(do_BHLD.sum(2), kv_heads)]
    if softcap is not None:
        sums += [v32.sum(2)]
    elif score_grad:
        m_BKDD = torch.einsum("bkjv,bkjd->bkvd", v32, k32)
        n_BKDD = _group_sum(torch.einsum("bhid,bhiv->bhdv", q_BHLD.to(ACC_DTYPE), do_BHLD), kv_heads)
        sums += [m_BKDD, k32.sum(2), v32.sum(2), n_BKDD]
    packed = all_reduce_sequence(torch.cat([s.flatten(2) for s in sums], dim=2), ring,
                                 "uniform hidden rows (backward)")
    dosum_BKD, *score_sums = (
        part.reshape(s.shape) for part, s in zip(packed.split([s[0, 0].numel() for s in sums], dim=2), sums))
    dv = (dosum_BKD / keys)[:, :, None, :] * real
    if not score_grad:
        return None, None, dv
    if softcap is not None:
        (vsum_BKD,) = score_sums
        dq, dk = _soft_capped_score_grads(do_BHLD, q_BHLD, k32, v32, vsum_BKD / keys, rows, keys, scale, ring,
                                          softcap.cap, mask.term(Alibi))
        return dq, dk, dv
    m_BKDD, ksum_BKD, vsum_BKD, n_BKDD = score_sums
    vbar_BKD = vsum_BKD / keys
    factor = scale / keys
    dot_BHL = torch.einsum("bhiv,bhv->bhi", do_BHLD, _per_query_head(vbar_BKD, heads_q))
    dq = factor * (torch.einsum("bhiv,bhvd->bhid", do_BHLD, _per_query_head(m_BKDD, heads_q))
                   - dot_BHL[..., None] * _per_query_head(ksum_BKD, heads_q)[:, :, None, :])
    dk = factor * torch.einsum("bkdv,bkjv->bkjd", n_BKDD, v32 - vbar_BKD[:, :, None, :]) * real
    return dq, dk, dv


# [B, H, slots, keys] fp32 score entries per chunk of hidden-row slots: 4 Mi entries, 16 MiB per buffer (the
# scores, their tanh, dP and dR: 64 MiB at a time)
_SOFT_CAP_CHUNK_ENTRIES = 1 << 22


def _soft_capped_score_grads(do_BHLD: Tensor, q_BHLD: Tensor, k32_BKLD: Tensor, v32_BKLD: Tensor, vbar_BKD: Tensor,
                             rows: HiddenRows, keys: int, scale: float, ring, cap: float, alibi: Alibi | None
                             ) -> tuple[Tensor, Tensor]:
    """The hidden rows' ``(dq, dk)`` shares through a soft-cap: ``dr_ij = (dO_i . v_j - dO_i . vbar) / n
    * (1 - tanh^2(r_ij / c))``, ``r_ij`` the scaled score (plus ALiBi's bias, applied before the cap), summed into
    ``dq_i = scale sum_j dr_ij k_j`` and ``dk_j = scale sum_i dr_ij q_i`` over every hidden row i and key j.
    ``do_BHLD`` is zero outside the hidden rows; ``k32`` / ``v32`` are zero at layout pads."""
    batch, heads_q, local_len, head_dim = q_BHLD.shape
    kv_heads = k32_BKLD.shape[1]
    # every hidden row of batch row b gets slot (its rank among b's hidden rows): [B, N] slots on every rank
    slots, b_idx, l_idx, slot_idx = rows.slots, rows.own_B, rows.own_L, rows.own_slot
    # gather (q, dO) of every hidden row by summing each rank's own rows into zeroed slots
    rows_BHND = q_BHLD.new_zeros((batch, heads_q, slots, 2 * head_dim), dtype=ACC_DTYPE)
    rows_BHND[b_idx, :, slot_idx] = torch.cat([q_BHLD.to(ACC_DTYPE), do_BHLD], dim=-1)[b_idx, :, l_idx]
    all_reduce_sequence(rows_BHND, ring, "soft-capped hidden rows (gather)")
    qh_BHND, doh_BHND = rows_BHND.split(head_dim, dim=-1)
    # slot positions (for ALiBi): the global position of each slot's row, 0 for unused slots (their dO is 0)
    pos_BN = torch.zeros(batch, slots, dtype=torch.int64, device=q_BHLD.device)
    pos_BN[rows.all_B, rows.all_slot] = rows.all_S
    groups = heads_q // kv_heads
    k_BHLD, v_BHLD = k32_BKLD.repeat_interleave(groups, 1), v32_BKLD.repeat_interleave(groups, 1)
    delta_BHN = torch.einsum("bhnd,bhd->bhn", doh_BHND, _per_query_head(vbar_BKD, heads_q))
    slopes_H = None if alibi is None else torch.tensor(alibi.slopes, dtype=ACC_DTYPE, device=q_BHLD.device)
    dq_BHND = torch.zeros_like(qh_BHND)
    dk_BHLD = torch.zeros_like(k_BHLD)
    chunk = max(1, _SOFT_CAP_CHUNK_ENTRIES // max(1, batch * heads_q * local_len))
    for lo in range(0, slots, chunk):
        hi = min(slots, lo + chunk)
        r_BHNL = torch.einsum("bhnd,bhld->bhnl", qh_BHND[:, :, lo:hi], k_BHLD) * scale
        if slopes_H is not None:
            distance_BNL = (rows.positions_L[None, None, :] - pos_BN[:, lo:hi, None]).to(ACC_DTYPE)
            r_BHNL = r_BHNL + slopes_H[None, :, None, None] * distance_BNL[:, None]
        tanh_BHNL = torch.tanh(r_BHNL / cap)
        dp_BHNL = torch.einsum("bhnd,bhld->bhnl", doh_BHND[:, :, lo:hi], v_BHLD)
        dr_BHNL = (dp_BHNL - delta_BHN[:, :, lo:hi, None]) / keys * (1 - tanh_BHNL * tanh_BHNL)
        dq_BHND[:, :, lo:hi] = torch.einsum("bhnl,bhld->bhnd", dr_BHNL, k_BHLD) * scale
        dk_BHLD += torch.einsum("bhnl,bhnd->bhld", dr_BHNL, qh_BHND[:, :, lo:hi]) * scale
    all_reduce_sequence(dq_BHND, ring, "soft-capped hidden rows (dq)")
    dq = torch.zeros(batch, heads_q, local_len, head_dim, dtype=ACC_DTYPE, device=q_BHLD.device)
    dq[b_idx, :, l_idx] = dq_BHND[b_idx, :, slot_idx]
    dk = _group_sum(dk_BHLD, kv_heads) * rows.real_L.to(ACC_DTYPE)[None, None, :, None]
    return dq, dk
