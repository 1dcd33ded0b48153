"""The ring loops: the forward and the one backward, over a :class:`burstc.ops.ring_comm.Ring`.

Forward: K/V blocks (with their ``Hkv`` heads, never repeated) travel around the ring; each rank
attends its resident queries to every block and merges the partial ``(out, lse)`` in fp32.

Backward, parametrized by what travels (:data:`BACKWARD_PLANS`):

* ``kv_ring``: K, V circulate again together with fp32 dK, dV accumulators that end at the block's
  owner.  Q, dO, dQ stay home.
* ``burst`` (BurstAttention): Q, dO, LSE and ``delta = rowsum(O * dO)`` circulate together with a
  travelling fp32 dQ accumulator that returns to its owner.  K, V, dK, dV never leave home.

Transfers are double-buffered: the next block's transfer is posted before the current block is
computed and waited for after.  A travelling accumulator trails its block by one step (it travels
from step 2 on) and makes one last hop home, where its owner's own (step 0) contribution waited.
Which (query, key) entries of a pair are computed is :func:`burstc.block_geometry.blocks`'s answer;
full and causal blocks without score mods run the flash-style kernels of
:mod:`burstc.kernels.attention_blocks`, the others the position-masked kernels of
:mod:`burstc.kernels.masked_attention_blocks`.

Runtime terms (documents, key padding): their data (``doc_ids_BS``, ``key_valid_BS``, the whole
sequence on every rank) are evaluated element-wise, so every block of the static geometry
(``mask.static_part``) runs the masked kernel, and a pair whose data show nothing visible (disjoint
document-id ranges, or no valid key, in every batch row) is skipped.  No block need then cover every
query row, and a row may see nothing at all: the forward merge starts from an empty accumulator
(out 0, lse -inf) and such a row ends with out 0, lse -inf (as single-device SDPA's 0) and zero
gradients.  Work counters count the entries the data leave visible.
LSE convention: :mod:`burstc.ops.lse_merge`.
"""
from __future__ import annotations

import dataclasses

import torch
from torch import Tensor

from burstc.attention_ir import Documents, KeyPadding, MaskSpec
from burstc.kernels.attention_blocks import block_attention_backward, block_attention_forward
from burstc.kernels.masked_attention_blocks import masked_block_backward, masked_block_forward, visible_entries
from burstc.block_geometry import POSITIONS, Block, blocks
from burstc.layout import local_positions
from burstc.ops.lse_merge import ACC_DTYPE, attention_delta, merge_attention_block_, merge_attention_block_or_empty_
from burstc.ops.ring_comm import DoubleBuffer, Ring, wait
from burstc.ops.ring_stats import CallRecorder

_DQ, _DK, _DV = 0, 1, 2  # positions in a block's (dq, dk, dv)


@dataclasses.dataclass(frozen=True)
class BackwardPlan:
    """What travels in the backward: the query side (Q, dO, LSE, delta with a dQ accumulator) or the
    key side (K, V with dK, dV accumulators).  The other side and its gradients stay home."""

    queries_travel: bool

    @property
    def travelling_grads(self) -> tuple[int, ...]:
        return (_DQ,) if self.queries_travel else (_DK, _DV)

    @property
    def home_grads(self) -> tuple[int, ...]:
        return (_DK, _DV) if self.queries_travel else (_DQ,)


BACKWARD_PLANS = {"kv_ring": BackwardPlan(queries_travel=False), "burst": BackwardPlan(queries_travel=True)}


@dataclasses.dataclass(frozen=True)
class MaskData:
    """Runtime mask data over the whole sequence (``[B, S_global]``, indexed by global position):
    document ids and key validity, each None when the spec lacks its term."""

    doc_ids_BS: Tensor | None = None
    key_valid_BS: Tensor | None = None

    def kernel_args(self) -> dict:
        return {"doc_ids_BS": self.doc_ids_BS, "key_valid_BS": self.key_valid_BS}


def _pair_blocks(layout: str, mask: MaskSpec, q_owner: int, kv_owner: int, local_len: int, ring: Ring,
                 data: MaskData) -> tuple[Block, ...]:
    """The blocks of a pair: :func:`blocks` of the static part, or none when the data show that
    nothing of the pair is visible in any batch row (exact, O(B * S_local))."""
    if not mask.runtime_terms:
        return blocks(layout, mask, q_owner, kv_owner, local_len, ring.size)
    found = blocks(layout, mask.static_part, q_owner, kv_owner, local_len, ring.size)
    if not found:
        return found
    some_data_BS = data.doc_ids_BS if data.doc_ids_BS is not None else data.key_valid_BS
    seq_len, device = local_len * ring.size, some_data_BS.device
    q_pos, kv_pos = (local_positions(seq_len, ring.size, owner, layout, device) for owner in (q_owner, kv_owner))
    hidden_B = torch.zeros(some_data_BS.shape[0], dtype=torch.bool, device=device)
    if mask.term(Documents) is not None:  # ids need not be sorted: disjoint [min, max] ranges never meet
        q_docs, kv_docs = data.doc_ids_BS[:, q_pos], data.doc_ids_BS[:, kv_pos]
        hidden_B = hidden_B | (q_docs.amax(1) < kv_docs.amin(1)) | (kv_docs.amax(1) < q_docs.amin(1))
    if mask.term(KeyPadding) is not None:
        hidden_B = hidden_B | ~data.key_valid_BS[:, kv_pos].any(1)
    return () if bool(hidden_B.all()) else found


def _positions_of(block: Block, mask: MaskSpec, layout: str, q_owner: int, kv_owner: int, local_len: int,
                  ring: Ring, device) -> tuple[Tensor, Tensor] | None:
    """The block's global ``(q positions, kv positions)`` when it needs the position-masked kernel
    (a :data:`POSITIONS` block, score mods, or runtime terms), else None (the flash-style kernels serve it)."""
    if block.mask != POSITIONS and not mask.score_mods and not mask.runtime_terms:
        return None
    seq_len = local_len * ring.size
    return (local_positions(seq_len, ring.size, q_owner, layout, device)[block.q_rows],
            local_positions(seq_len, ring.size, kv_owner, layout, device)[block.kv_rows])


def _record(recorder: CallRecorder, step: int, block: Block, positions, mask: MaskSpec, data: MaskData,
            batch: int, heads_q: int) -> None:
    """Count the block's work: with runtime terms, the entries the data leave visible."""
    visible = None
    if recorder.enabled and mask.runtime_terms:
        visible = int(visible_entries(*positions, mask, **data.kernel_args()).sum())
    recorder.computed(step, block, batch, heads_q, visible)


def ring_forward(q_BHSD: Tensor, k_BHSD: Tensor, v_BHSD: Tensor, ring: Ring, layout: str, mask: MaskSpec,
                 scale: float, data: MaskData = MaskData()) -> tuple[Tensor, Tensor]:
    """This rank's ``(out in q.dtype, lse_BHS fp32)`` rows of attention over the whole ring."""
    batch, heads_q, local_len, head_dim = q_BHSD.shape
    recorder = CallRecorder("forward", None, ring, layout, mask.encode(), q_BHSD, k_BHSD)
    kv_cur = [k_BHSD.contiguous(), v_BHSD.contiguous()]
    kv_buffers = DoubleBuffer(kv_cur)
    out_acc = lse_acc = None
    if mask.runtime_terms:  # rows may see nothing in a block, or anywhere: start empty
        out_acc = torch.zeros(batch, heads_q, local_len, head_dim, dtype=ACC_DTYPE, device=q_BHSD.device)
        lse_acc = torch.full((batch, heads_q, local_len), float("-inf"), dtype=ACC_DTYPE, device=q_BHSD.device)
    for step in range(ring.size):
        kv_owner = (ring.rank - step) % ring.size
        requests = []
        if step < ring.size - 1:
            kv_next = kv_buffers.get(step)
            requests = ring.post(kv_cur, kv_next, recorder, step)
        for block in _pair_blocks(layout, mask, ring.rank, kv_owner, local_len, ring, data):
            q_blk, k_blk, v_blk = q_BHSD[:, :, block.q_rows], *(t[:, :, block.kv_rows] for t in kv_cur)
            positions = _positions_of(block, mask, layout, ring.rank, kv_owner, local_len, ring, q_BHSD.device)
            if positions is None:
                out_blk, lse_blk = block_attention_forward(q_blk, k_blk, v_blk, block.causal, scale)
            else:
                out_blk, lse_blk = masked_block_forward(q_blk, k_blk, v_blk, *positions, mask, scale,
                                                        **data.kernel_args())
            _record(recorder, step, block, positions, mask, data, batch, heads_q)
            if mask.runtime_terms:
                rows = block.q_rows
                merge_attention_block_or_empty_(out_acc[:, :, rows], lse_acc[:, :, rows], out_blk, lse_blk)
            elif out_acc is None:
                # The first block (step 0, the own diagonal one) starts the accumulators: it must
                # cover every query row, as the merge has no -inf start (blocks() keeps the own pair of a
                # static mask one block, and every row sees its diagonal).
                if (block.q_start, block.q_stop) != (0, local_len):
                    raise NotImplementedError(f"first block {block} does not cover all {local_len} query rows")
                out_acc, lse_acc = out_blk.to(ACC_DTYPE), lse_blk
            else:
                merge_attention_block_(out_acc[:, :, block.q_rows], lse_acc[:, :, block.q_rows], out_blk, lse_blk)
        wait(requests)
        if requests:
            kv_cur = kv_next
    recorder.publish()
    return out_acc.to(q_BHSD.dtype).contiguous(), lse_acc.contiguous()


def ring_backward(plan: str, grad_out_BHSD: Tensor, q_BHSD: Tensor, k_BHSD: Tensor, v_BHSD: Tensor,
                  out_BHSD: Tensor, lse_BHS: Tensor, grad_lse_BHS: Tensor | None, ring: Ring, layout: str,
                  mask: MaskSpec, scale: float, data: MaskData = MaskData()) -> tuple[Tensor, Tensor, Tensor]:
    """``(dq, dk, dv)`` of this rank's shards, contiguous in the inputs' dtypes, with backward ``plan``."""
    grad_out_BHSD = grad_out_BHSD.to(q_BHSD.dtype).contiguous()
    lse_BHS = lse_BHS.to(ACC_DTYPE).contiguous()
    # An lse gradient g adds P * g to d(scores): the same as using delta - g (only delta changes).
    lse_has_grad = grad_lse_BHS is not None and bool(grad_lse_BHS.ne(0).any())
    recorder = CallRecorder("backward", plan, ring, layout, mask.encode(), q_BHSD, k_BHSD)
    if BACKWARD_PLANS[plan].queries_travel:  # delta travels with the queries
        delta_BHS = attention_delta(out_BHSD, grad_out_BHSD)
        if lse_has_grad:
            delta_BHS = delta_BHS - grad_lse_BHS.to(ACC_DTYPE)
        delta_BHS = delta_BHS.contiguous()
    else:  # the kernels read delta from the resident ``out``, unless an lse gradient adjusts it
        delta_BHS = attention_delta(out_BHSD, grad_out_BHSD) - grad_lse_BHS.to(ACC_DTYPE) if lse_has_grad else None
    # ``out`` is only right for the kernel where delta is not adjusted; else a stand-in carries delta.
    grads = _backward_loop(BACKWARD_PLANS[plan], grad_out_BHSD, q_BHSD, k_BHSD, v_BHSD,
                           None if lse_has_grad else out_BHSD, lse_BHS, delta_BHS, ring, layout, mask, scale, recorder,
                           data)
    recorder.publish()
    return tuple(g.contiguous() for g in grads)


def _rows(grad: int, block: Block) -> slice:
    return block.q_rows if grad == _DQ else block.kv_rows


def _add_rows_(acc: Tensor, rows: slice, part: Tensor) -> None:
    acc[:, :, rows] += part.to(acc.dtype)


def _backward_loop(plan: BackwardPlan, grad_out, q, k, v, out, lse, delta, ring: Ring, layout: str,
                   mask: MaskSpec, scale: float, recorder: CallRecorder, data: MaskData):
    """The one backward loop.  At step i the travelling side held here belongs to rank (rank - i).

    Gradients of the side at home accumulate at home before the step's transfers are waited for;
    those of the travelling side go into the accumulator of the block held now (rank's own at step 0,
    the arriving one from step 1 on, zeroed at its first use), which is forwarded at the next step.
    """
    size, rank = ring.size, ring.rank
    batch, heads_q, local_len, _ = q.shape
    grads = (torch.zeros(q.shape, dtype=ACC_DTYPE, device=q.device),
             torch.zeros(k.shape, dtype=ACC_DTYPE, device=k.device))
    grads += (torch.zeros_like(grads[_DK]),)
    if plan.queries_travel:
        travelling, home = [q.contiguous(), grad_out, lse, delta], [k, v]
    else:
        travelling, home = [k.contiguous(), v.contiguous()], [q, grad_out, lse, delta]
    acc_home = [grads[i] for i in plan.travelling_grads]
    travel_buffers = DoubleBuffer(travelling)
    acc_buffers = DoubleBuffer(acc_home, ACC_DTYPE)
    for step in range(size):
        visitor = (rank - step) % size  # owner of the travelling side held now
        q_owner, kv_owner = (visitor, rank) if plan.queries_travel else (rank, visitor)
        requests, arriving = _post_backward_step(ring, recorder, step, travelling, travel_buffers, acc_buffers)
        (q_cur, grad_out_cur, lse_cur, delta_cur), (k_cur, v_cur) = (
            (travelling, home) if plan.queries_travel else (home, travelling))
        own_out = out if q_owner == rank else None
        computed = []
        for block in _pair_blocks(layout, mask, q_owner, kv_owner, local_len, ring, data):
            rows, cols = block.q_rows, block.kv_rows
            inputs = (grad_out_cur[:, :, rows], q_cur[:, :, rows], k_cur[:, :, cols], v_cur[:, :, cols],
                      lse_cur[:, :, rows], None if delta_cur is None else delta_cur[:, :, rows],
                      None if own_out is None else own_out[:, :, rows])
            positions = _positions_of(block, mask, layout, q_owner, kv_owner, local_len, ring, q.device)
            if positions is None:
                block_grads = block_attention_backward(*inputs, block.causal, scale)
            else:
                block_grads = masked_block_backward(*inputs, *positions, mask, scale, **data.kernel_args())
            _record(recorder, step, block, positions, mask, data, batch, heads_q)
            for i in plan.home_grads:
                _add_rows_(grads[i], _rows(i, block), block_grads[i])
            computed.append((block, block_grads))
        wait(requests)
        travel_acc = acc_home if step == 0 else acc_buffers.get(step, zero=(step == 1))
        for block, block_grads in computed:
            for acc, i in zip(travel_acc, plan.travelling_grads):
                _add_rows_(acc, _rows(i, block), block_grads[i])
        if step < size - 1:
            travelling = arriving
    _return_accumulators_home(ring, recorder, acc_buffers, acc_home)
    return grads[_DQ].to(q.dtype), grads[_DK].to(k.dtype), grads[_DV].to(v.dtype)


def _post_backward_step(ring: Ring, recorder: CallRecorder, step: int, travelling, travel_buffers: DoubleBuffer,
                        acc_buffers: DoubleBuffer):
    """Post one backward step's transfers: the inputs that travel (until the last step) and, from
    step 2 on, the gradient accumulator finished at the previous step (the one of the block held now
    arrives).  Returns ``(requests, the arriving inputs or None)``."""
    sends, recvs, arriving = [], [], None
    if step < ring.size - 1:
        arriving = travel_buffers.get(step)
        sends += travelling
        recvs += arriving
    if step >= 2:
        sends += acc_buffers.get(step - 1)
        recvs += acc_buffers.get(step)
    return ring.post(sends, recvs, recorder, step), arriving


def _return_accumulators_home(ring: Ring, recorder: CallRecorder, acc_buffers: DoubleBuffer, home: list[Tensor]) -> None:
    """Last hop: each travelling accumulator reaches its owner and adds into the owner's own share."""
    if ring.size == 1:
        return
    returned = acc_buffers.get(ring.size)
    wait(ring.post(acc_buffers.get(ring.size - 1), returned, recorder, ring.size))
    for acc, part in zip(home, returned):
        acc += part
