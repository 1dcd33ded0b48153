"""BurstAttention ring attention over a 1-D process group.

Every rank holds ``S/P`` tokens of q, k and v (SDPA layout ``[B, H, S_local, D]``) in the order
given by :func:`burstc.layout.local_positions`.  The result on each rank equals that rank's rows of
single-device ``F.scaled_dot_product_attention(q, k, v, is_causal=causal, scale=scale,
enable_gqa=True)``.

Forward: K/V blocks (with their ``Hkv`` heads, never repeated) travel around the ring; each rank
attends its resident queries to every block and merges the partial ``(out, lse)`` with the stable
online-softmax merge in fp32.  Backward, one of two plans per call:

* ``kv_ring``: K, V circulate again together with fp32 dK, dV accumulators that end at the block's
  owner.  Q, dO, dQ stay home.
* ``burst`` (BurstAttention): Q, dO, LSE and ``delta = rowsum(O * dO)`` circulate together with a
  travelling fp32 dQ accumulator that returns to its owner.  K, V, dK, dV never leave home.
  Cheaper than ``kv_ring`` for MHA, dearer for GQA (``burstc.planner`` decides for ``"auto"``).

Both run as ``torch.library.custom_op``s (``burstc::ring_attention_forward`` /
``burstc::ring_attention_backward``) that take the process group by its registered name, so they
work eagerly and inside ``torch.compile(fullgraph=True)``.

Transfers are double-buffered: the next block's transfer is posted before the current block is
computed and waited for after.  :func:`record_stats` collects, per call and rank, the exact bytes
handed to ``isend`` and the number of unmasked score entries computed at every ring step.

LSE convention (the same everywhere in this module): fp32, natural log of the *scaled* scores,
shape ``[B, H, S]`` and contiguous.  :func:`_lse_to_BHS` is the one place that converts a kernel's
LSE to it.
"""
from __future__ import annotations

import contextlib
import dataclasses
from typing import Iterator, Sequence

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor

from burstc.layout import check_layout
from burstc.ops.autocast import cast_like_lower_precision, register_lower_precision, without_autocast

aten = torch.ops.aten

PLANS = ("kv_ring", "burst")
PLAN_CHOICES = ("auto",) + PLANS
SUPPORTED_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
ACC_DTYPE = torch.float32  # accumulators (out, lse, dq, dk, dv, delta) and everything fp32 on the wire


# ---------------------------------------------------------------------------------------------
# Statistics: bytes handed to isend and score entries computed, per ring step


@dataclasses.dataclass
class RingCallStats:
    """One op call on one rank.

    ``work_per_step[i]``: unmasked score entries (B * Hq * allowed (query, key) pairs) computed at
    compute step ``i`` (``P`` entries; step ``i`` uses the block that started at rank - i).
    ``bytes_sent_per_step[i]``: bytes of every tensor handed to ``isend`` while step ``i`` is
    computed (posted before it, waited for after it).  The forward has ``P`` entries (the last is
    0: nothing left to send); the backward has ``P + 1``: the extra last entry is the hop that
    returns the travelling gradient accumulator (dK/dV or dQ) to its owner.  Empty when P = 1.
    """

    op: str                 # "forward" | "backward"
    plan: str | None        # resolved backward plan; None for the forward
    rank: int
    world_size: int
    layout: str
    causal: bool
    shape: tuple[int, int, int, int, int]  # (B, Hq, Hkv, S_local, D)
    dtype: str
    bytes_sent_per_step: list[int]
    work_per_step: list[int]

    @property
    def total_bytes_sent(self) -> int:
        return sum(self.bytes_sent_per_step)

    @property
    def total_work(self) -> int:
        return sum(self.work_per_step)


@dataclasses.dataclass
class RingStats:
    """Collected by :func:`record_stats`; ``calls`` in call order (this process = one rank)."""

    calls: list[RingCallStats] = dataclasses.field(default_factory=list)

    def of(self, op: str) -> list[RingCallStats]:
        return [c for c in self.calls if c.op == op]


_active_recorders: list[RingStats] = []


@contextlib.contextmanager
def record_stats() -> Iterator[RingStats]:
    """Record every ring-attention call (eager or compiled) made inside the ``with`` block."""
    stats = RingStats()
    _active_recorders.append(stats)
    try:
        yield stats
    finally:
        _active_recorders.remove(stats)


class _CallRecorder:
    """Per-call counters; publishes to the active recorders when the call finishes."""

    def __init__(self, op, plan, ring, layout, causal, q, k):
        self.enabled = bool(_active_recorders)
        if not self.enabled:
            return
        batch, heads_q, local_len, head_dim = q.shape
        steps = ring.size + (1 if op == "backward" else 0)
        self.stats = RingCallStats(
            op=op, plan=plan, rank=ring.rank, world_size=ring.size, layout=layout, causal=causal,
            shape=(batch, heads_q, k.shape[1], local_len, head_dim), dtype=str(q.dtype).removeprefix("torch."),
            bytes_sent_per_step=[0] * steps if ring.size > 1 else [], work_per_step=[0] * ring.size,
        )

    def sent(self, step: int, tensors: Sequence[Tensor]) -> None:
        if self.enabled:
            self.stats.bytes_sent_per_step[step] += sum(t.numel() * t.element_size() for t in tensors)

    def computed(self, step: int, spec: "BlockSpec | None", batch: int, heads_q: int) -> None:
        if self.enabled and spec is not None:
            self.stats.work_per_step[step] += batch * heads_q * spec.score_entries

    def publish(self) -> None:
        if self.enabled:
            for recorder in _active_recorders:
                recorder.calls.append(self.stats)


# ---------------------------------------------------------------------------------------------
# Which part of a (query shard, key/value shard) pair to compute: the causal work balance


@dataclasses.dataclass(frozen=True)
class BlockSpec:
    """Compute attention of query rows ``[q_start, q_stop)`` against key rows ``[kv_start,
    kv_stop)`` of the two shards, top-left causal on that sub-block if ``causal``, else full."""

    q_start: int
    q_stop: int
    kv_start: int
    kv_stop: int
    causal: bool

    @property
    def q_rows(self) -> slice:
        return slice(self.q_start, self.q_stop)

    @property
    def kv_rows(self) -> slice:
        return slice(self.kv_start, self.kv_stop)

    @property
    def score_entries(self) -> int:
        """Unmasked (query, key) pairs of the sub-block (top-left causal: row i sees i + 1 keys)."""
        rows, cols = self.q_stop - self.q_start, self.kv_stop - self.kv_start
        if not self.causal:
            return rows * cols
        triangle = min(rows, cols)
        return triangle * (triangle + 1) // 2 + (rows - triangle) * cols


def block_spec(layout: str, causal: bool, q_owner: int, kv_owner: int, local_len: int) -> BlockSpec | None:
    """The sub-block of (queries of rank ``q_owner``) x (keys of rank ``kv_owner``) that the causal
    mask leaves, expressed so that one dense or top-left-causal kernel call computes it exactly.
    ``None``: the mask removes the whole pair.  Local order is increasing global order, so a
    causal mask between shards of the same rank is the plain local causal mask.
    """
    s = local_len
    if not causal:
        return BlockSpec(0, s, 0, s, False)
    if q_owner == kv_owner:
        return BlockSpec(0, s, 0, s, True)
    if layout == "zigzag":
        # Rank r holds chunks r (head) and 2P-1-r (tail), s/2 tokens each.  An earlier rank's
        # head precedes all our queries and its tail follows them: all q x first half of kv.  A
        # later rank's chunks both follow our head and precede our tail: second half of q x all kv.
        half = s // 2
        if kv_owner < q_owner:
            return BlockSpec(0, s, 0, half, False)
        return BlockSpec(half, s, 0, s, False)
    if layout == "striped":
        # Query i is global i*P + q_owner, key j is j*P + kv_owner.  kv_owner < q_owner: j <= i
        # (causal).  kv_owner > q_owner: j < i, i.e. causal on (q[1:], k[:-1]).
        if kv_owner < q_owner:
            return BlockSpec(0, s, 0, s, True)
        return BlockSpec(1, s, 0, s - 1, True) if s > 1 else None
    # contiguous: earlier shards are entirely visible, later ones entirely masked
    return BlockSpec(0, s, 0, s, False) if kv_owner < q_owner else None


# ---------------------------------------------------------------------------------------------
# Local block kernels (the dispatch point for device kernels, e.g. a later Triton kernel)


def _lse_to_BHS(lse: Tensor) -> Tensor:
    """The CPU flash kernel returns a natural-log LSE of the scaled scores as a ``[B, H, S]``
    view of a ``[B, S, H]`` buffer (strides ``(S*H, 1, H)``); make it fp32 ``[B, H, S]``
    contiguous, the convention of this module (the kernel's backward accepts that layout)."""
    return lse.to(ACC_DTYPE).contiguous()


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
        return out, _lse_to_BHS(lse)
    return _reference_block_forward(q_BHSD, k_BHSD, v_BHSD, causal, scale)


def block_attention_backward(grad_out_BHSD: Tensor, q_BHSD: Tensor, k_BHSD: Tensor, v_BHSD: Tensor,
                             lse_BHS: Tensor, delta_BHS: Tensor | None, out_BHSD: Tensor | None,
                             causal: bool, scale: float) -> tuple[Tensor, Tensor, Tensor]:
    """Gradients of one block given the *global* softmax statistics of its query rows.

    ``lse_BHS`` and ``delta_BHS = rowsum(out * grad_out)`` (fp32) are those of the full attention
    row, so per-block results add up to the exact gradients.  Pass ``out_BHSD`` (the global output
    rows) or ``delta_BHS``, or both (then they must agree).  On CPU the flash kernel runs (with a
    stand-in output when only delta is given); the plain-torch kernel otherwise, and on CPU when
    no stand-in exists (see :func:`stand_in_output`).
    """
    if _use_cpu_flash(q_BHSD):
        if out_BHSD is None:
            out_BHSD = stand_in_output(grad_out_BHSD, delta_BHS)
        if out_BHSD is not None:
            return aten._scaled_dot_product_flash_attention_for_cpu_backward(
                grad_out_BHSD, q_BHSD, k_BHSD, v_BHSD, out_BHSD, lse_BHS, 0.0, causal, scale=scale)
    if delta_BHS is None:
        delta_BHS = attention_delta(out_BHSD, grad_out_BHSD)
    return _reference_block_backward(grad_out_BHSD, q_BHSD, k_BHSD, v_BHSD, lse_BHS, delta_BHS, causal, scale)


def attention_delta(out_BHSD: Tensor, grad_out_BHSD: Tensor) -> Tensor:
    """``delta = rowsum(out * grad_out)`` in fp32, shape ``[B, H, S]``."""
    return (out_BHSD.to(ACC_DTYPE) * grad_out_BHSD.to(ACC_DTYPE)).sum(-1)


def stand_in_output(grad_out_BHSD: Tensor, delta_BHS: Tensor) -> Tensor | None:
    """An ``out`` for the CPU flash backward that only reproduces ``rowsum(out * grad_out) = delta``.

    The kernel uses ``out`` for nothing else (tests check it: perturbing out orthogonally to
    grad_out leaves all gradients unchanged), so ``grad_out * delta / rowsum(grad_out**2)``
    replaces the real output of a query block that lives on another rank, and only the fp32 row
    ``delta`` has to travel.  Exact up to fp32 rounding for fp32 inputs; in bf16/fp16 the stand-in
    is rounded like any output.  A row with ``grad_out = 0`` gets 0, which is right when ``delta =
    0`` there (no lse gradient); ``None`` if some such row has ``delta != 0`` (only an lse gradient
    can do that): no stand-in exists and the caller must use a kernel that takes delta.
    """
    grad_out = grad_out_BHSD.to(ACC_DTYPE)
    norm_sq = (grad_out * grad_out).sum(-1, keepdim=True)
    delta = delta_BHS.unsqueeze(-1)
    if bool(((norm_sq == 0) & (delta != 0)).any()):
        return None
    ratio = torch.where(norm_sq > 0, delta / norm_sq, torch.zeros_like(norm_sq))
    return (grad_out * ratio).to(grad_out_BHSD.dtype)


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


def _reference_block_forward(q, k, v, causal, scale):
    groups = q.shape[1] // k.shape[1]
    acc = torch.promote_types(q.dtype, ACC_DTYPE)
    k32, v32 = _repeat_kv_heads(k, groups).to(acc), _repeat_kv_heads(v, groups).to(acc)
    outs, lses = [], []
    chunk = _reference_row_chunk(q.shape[0], q.shape[1], k.shape[2])
    for start in range(0, q.shape[2], chunk):
        q32 = q[:, :, start:start + chunk].to(acc)
        scores = (q32 @ k32.transpose(-1, -2)) * scale
        if causal:
            scores = scores.masked_fill(~_causal_mask(start, q32.shape[2], k.shape[2], q.device), float("-inf"))
        lse = torch.logsumexp(scores, -1)
        outs.append(torch.exp(scores - lse.unsqueeze(-1)) @ v32)
        lses.append(lse)
    return torch.cat(outs, 2).to(q.dtype), torch.cat(lses, 2).contiguous()


def _reference_block_backward(grad_out, q, k, v, lse, delta, causal, scale):
    batch, heads_q, _, head_dim = q.shape
    heads_kv, kv_len = k.shape[1], k.shape[2]
    groups = heads_q // heads_kv
    acc = torch.promote_types(q.dtype, ACC_DTYPE)
    k32, v32 = _repeat_kv_heads(k, groups).to(acc), _repeat_kv_heads(v, groups).to(acc)
    dq_chunks = []
    dk32 = torch.zeros(batch, heads_q, kv_len, head_dim, dtype=acc, device=q.device)
    dv32 = torch.zeros_like(dk32)
    chunk = _reference_row_chunk(batch, heads_q, kv_len)
    for start in range(0, q.shape[2], chunk):
        rows = slice(start, start + chunk)
        q32, do32 = q[:, :, rows].to(acc), grad_out[:, :, rows].to(acc)
        scores = (q32 @ k32.transpose(-1, -2)) * scale
        if causal:
            scores = scores.masked_fill(~_causal_mask(start, q32.shape[2], kv_len, q.device), float("-inf"))
        probs = torch.exp(scores - lse[:, :, rows].unsqueeze(-1))
        dv32 += probs.transpose(-1, -2) @ do32
        # d(scores) = P * (dP - delta): softmax backward with the global row statistic delta
        dscores = probs * (do32 @ v32.transpose(-1, -2) - delta[:, :, rows].unsqueeze(-1))
        dq_chunks.append((dscores @ k32) * scale)
        dk32 += (dscores.transpose(-1, -2) @ q32) * scale
    fold = lambda t: t.view(batch, heads_kv, groups, kv_len, head_dim).sum(2)  # noqa: E731
    return torch.cat(dq_chunks, 2).to(q.dtype), fold(dk32).to(k.dtype), fold(dv32).to(v.dtype)


def merge_attention_block_(out_acc_BHSD: Tensor, lse_acc_BHS: Tensor, out_blk_BHSD: Tensor, lse_blk_BHS: Tensor) -> None:
    """In place, fp32: fold a block's normalized ``(out, lse)`` into the running ``(out, lse)``.

    The sigmoid form is the stable rewrite of ``new = logaddexp(lse, lse_blk); out = out *
    exp(lse - new) + out_blk * exp(lse_blk - new)``: nothing is exponentiated that can overflow,
    and a block row with ``lse_blk = -inf`` (all masked) leaves the row unchanged.
    """
    lse_blk = lse_blk_BHS.to(lse_acc_BHS.dtype)
    weight_blk = torch.sigmoid(lse_blk - lse_acc_BHS).unsqueeze(-1)
    out_acc_BHSD.sub_(weight_blk * (out_acc_BHSD - out_blk_BHSD.to(out_acc_BHSD.dtype)))
    lse_acc_BHS.sub_(F.logsigmoid(lse_acc_BHS - lse_blk))


# ---------------------------------------------------------------------------------------------
# The ring


class _Ring:
    """Neighbours of this rank in a 1-D group: blocks move to rank + 1 and arrive from rank - 1."""

    def __init__(self, group: dist.ProcessGroup):
        self.group = group
        self.size = group.size()
        self.rank = group.rank()
        self.next_peer = dist.get_global_rank(group, (self.rank + 1) % self.size)
        self.prev_peer = dist.get_global_rank(group, (self.rank - 1) % self.size)

    def post(self, sends: Sequence[Tensor], recvs: Sequence[Tensor], recorder: _CallRecorder, step: int):
        """Start sending ``sends`` to the next rank and receiving ``recvs`` (same shapes, same order
        on every rank) from the previous one.  Returns the requests to wait for."""
        if not sends:
            return []
        ops = [dist.P2POp(dist.isend, t, self.next_peer, self.group) for t in sends]
        ops += [dist.P2POp(dist.irecv, t, self.prev_peer, self.group) for t in recvs]
        recorder.sent(step, sends)
        return dist.batch_isend_irecv(ops)


def _wait(requests) -> None:
    for request in requests:
        request.wait()


class _DoubleBuffer:
    """Two sets of receive buffers used alternately: step ``i`` receives into set ``i % 2`` while
    the set received at step ``i - 1`` is read (and forwarded).  Allocated on first use."""

    def __init__(self, like: Sequence[Tensor], dtype: torch.dtype | None = None):
        self._like, self._dtype = like, dtype
        self._sets: list[list[Tensor] | None] = [None, None]

    def get(self, step: int, zero: bool = False) -> list[Tensor]:
        slot = self._sets[step % 2]
        if slot is None:
            slot = self._sets[step % 2] = [
                torch.empty(t.shape, dtype=self._dtype or t.dtype, device=t.device) for t in self._like]
        if zero:
            for t in slot:
                t.zero_()
        return slot


# ---------------------------------------------------------------------------------------------
# Forward


def _ring_forward(q, k, v, ring: _Ring, causal: bool, layout: str, scale: float):
    batch, heads_q, local_len, _ = q.shape
    recorder = _CallRecorder("forward", None, ring, layout, causal, q, k)
    kv_cur = [k.contiguous(), v.contiguous()]
    kv_buffers = _DoubleBuffer(kv_cur)
    out_acc = lse_acc = None
    for step in range(ring.size):
        kv_owner = (ring.rank - step) % ring.size
        requests = []
        if step < ring.size - 1:
            kv_next = kv_buffers.get(step)
            requests = ring.post(kv_cur, kv_next, recorder, step)
        spec = block_spec(layout, causal, ring.rank, kv_owner, local_len)
        if spec is not None:
            k_blk, v_blk = (t[:, :, spec.kv_rows] for t in kv_cur)
            out_blk, lse_blk = block_attention_forward(q[:, :, spec.q_rows], k_blk, v_blk, spec.causal, scale)
            recorder.computed(step, spec, batch, heads_q)
            if out_acc is None:  # step 0 (own block, diagonal present) covers every query row
                out_acc, lse_acc = out_blk.to(ACC_DTYPE), lse_blk
            else:
                merge_attention_block_(out_acc[:, :, spec.q_rows], lse_acc[:, :, spec.q_rows], out_blk, lse_blk)
        _wait(requests)
        if requests:
            kv_cur = kv_next
    recorder.publish()
    return out_acc.to(q.dtype).contiguous(), lse_acc.contiguous()


# ---------------------------------------------------------------------------------------------
# Backward plans


def _add_rows_(acc: Tensor, rows: slice, part: Tensor) -> None:
    acc[:, :, rows] += part.to(acc.dtype)


def _post_backward_step(ring: _Ring, recorder, step: int, travelling, travel_buffers: _DoubleBuffer,
                        acc_buffers: _DoubleBuffer):
    """Post one backward step's transfers, shared by both plans: the inputs that travel (until the last
    step) and, from step 2 on, the gradient accumulator finished at the previous step (the one of the
    block held now arrives).  Returns ``(requests, the arriving inputs or None)``."""
    sends, recvs, arriving = [], [], None
    if step < ring.size - 1:
        arriving = travel_buffers.get(step)
        sends += travelling
        recvs += arriving
    if step >= 2:
        sends += acc_buffers.get(step - 1)
        recvs += acc_buffers.get(step)
    return ring.post(sends, recvs, recorder, step), arriving


def _return_accumulators_home(ring: _Ring, recorder, acc_buffers: _DoubleBuffer, home: list[Tensor]) -> None:
    """Last hop: each travelling accumulator reaches its owner and adds into the owner's own share."""
    if ring.size == 1:
        return
    returned = acc_buffers.get(ring.size)
    _wait(ring.post(acc_buffers.get(ring.size - 1), returned, recorder, ring.size))
    for acc, part in zip(home, returned):
        acc += part


def _kv_ring_backward(grad_out, q, k, v, out, lse, delta, ring: _Ring, causal, layout, scale, recorder):
    """K, V circulate with fp32 dK, dV accumulators; dQ accumulates at home.

    The accumulator of the block that started at rank j collects the contributions of ranks j+1,
    ..., j+P-1 (it travels from step 2 on, one step behind its K/V) and then makes one last hop
    home, where rank j's own (step 0) contribution waited: P-1 hops of K, V and P-1 of dK, dV.
    """
    batch, heads_q, local_len, _ = q.shape
    size, rank = ring.size, ring.rank
    dq_acc = torch.zeros(q.shape, dtype=ACC_DTYPE, device=q.device)
    dk_home = torch.zeros(k.shape, dtype=ACC_DTYPE, device=k.device)
    dv_home = torch.zeros_like(dk_home)
    kv_cur = [k.contiguous(), v.contiguous()]
    kv_buffers = _DoubleBuffer(kv_cur)
    dkv_buffers = _DoubleBuffer([dk_home, dv_home], ACC_DTYPE)
    # The kernel reads delta from ``out``; a delta adjusted for grad_lse comes via the stand-in.
    out_for_kernel = out if delta is None else None
    for step in range(size):
        kv_owner = (rank - step) % size
        requests, kv_next = _post_backward_step(ring, recorder, step, kv_cur, kv_buffers, dkv_buffers)
        spec = block_spec(layout, causal, rank, kv_owner, local_len)
        grads = None
        if spec is not None:
            rows, cols = spec.q_rows, spec.kv_rows
            grads = block_attention_backward(
                grad_out[:, :, rows], q[:, :, rows], kv_cur[0][:, :, cols], kv_cur[1][:, :, cols],
                lse[:, :, rows], None if delta is None else delta[:, :, rows],
                None if out_for_kernel is None else out_for_kernel[:, :, rows], spec.causal, scale)
            recorder.computed(step, spec, batch, heads_q)
            _add_rows_(dq_acc, rows, grads[0])
        _wait(requests)
        dk_acc, dv_acc = (dk_home, dv_home) if step == 0 else dkv_buffers.get(step, zero=(step == 1))
        if grads is not None:
            _add_rows_(dk_acc, spec.kv_rows, grads[1])
            _add_rows_(dv_acc, spec.kv_rows, grads[2])
        if step < size - 1:
            kv_cur = kv_next
    _return_accumulators_home(ring, recorder, dkv_buffers, [dk_home, dv_home])
    return dq_acc.to(q.dtype), dk_home.to(k.dtype), dv_home.to(v.dtype)


def _burst_backward(grad_out, q, k, v, out, lse, delta, ring: _Ring, causal, layout, scale, recorder,
                    out_is_consistent: bool):
    """BurstAttention: Q, dO, LSE, delta circulate with an fp32 dQ accumulator; K, V, dK, dV stay.

    The roles flip against the forward: at step i this rank's K/V serve the queries of rank
    (rank - i).  dQ contributions travel like kv_ring's dK/dV (P-1 hops); the receiving rank
    rebuilds a stand-in output from dO and delta for the CPU kernel (see :func:`stand_in_output`).
    """
    size, rank = ring.size, ring.rank
    batch, heads_q, local_len, _ = q.shape
    dq_home = torch.zeros(q.shape, dtype=ACC_DTYPE, device=q.device)
    dk_acc = torch.zeros(k.shape, dtype=ACC_DTYPE, device=k.device)
    dv_acc = torch.zeros_like(dk_acc)
    read_cur = [q.contiguous(), grad_out, lse, delta]  # what a query block needs for its gradients
    read_buffers = _DoubleBuffer(read_cur)
    dq_buffers = _DoubleBuffer([dq_home], ACC_DTYPE)
    for step in range(size):
        q_owner = (rank - step) % size
        requests, read_next = _post_backward_step(ring, recorder, step, read_cur, read_buffers, dq_buffers)
        spec = block_spec(layout, causal, q_owner, rank, local_len)
        grads = None
        if spec is not None:
            rows, cols = spec.q_rows, spec.kv_rows
            q_blk, grad_out_blk, lse_blk, delta_blk = (t[:, :, rows] for t in read_cur)
            own_out = out[:, :, rows] if step == 0 and out_is_consistent else None
            grads = block_attention_backward(
                grad_out_blk, q_blk, k[:, :, cols], v[:, :, cols], lse_blk, delta_blk, own_out, spec.causal, scale)
            recorder.computed(step, spec, batch, heads_q)
            _add_rows_(dk_acc, cols, grads[1])
            _add_rows_(dv_acc, cols, grads[2])
        _wait(requests)
        (dq_acc,) = (dq_home,) if step == 0 else dq_buffers.get(step, zero=(step == 1))
        if grads is not None:
            _add_rows_(dq_acc, spec.q_rows, grads[0])
        if step < size - 1:
            read_cur = read_next
    _return_accumulators_home(ring, recorder, dq_buffers, [dq_home])
    return dq_home.to(q.dtype), dk_acc.to(k.dtype), dv_acc.to(v.dtype)


def resolve_plan(plan: str, q: Tensor, k: Tensor, world_size: int) -> str:
    """``"auto"`` -> the planner's cheaper backward for this call's shapes; else ``plan``."""
    if plan != "auto":
        return plan
    from burstc.planner import plan_attention

    batch, heads_q, local_len, head_dim = q.shape
    return plan_attention(batch, local_len * world_size, world_size, heads_q, k.shape[1], head_dim, q.dtype).plan


# ---------------------------------------------------------------------------------------------
# Custom ops


def _resolve_group(group_name: str) -> dist.ProcessGroup:
    from torch.distributed.distributed_c10d import _resolve_process_group

    return _resolve_process_group(group_name)


@torch.library.custom_op("burstc::ring_attention_forward", mutates_args=())
@without_autocast
def _ring_attention_forward_op(q: Tensor, k: Tensor, v: Tensor, group_name: str, causal: bool, layout: str,
                               scale: float, plan: str) -> tuple[Tensor, Tensor]:
    # ``plan`` is unused here; it rides along so that the autograd context has it.
    return _ring_forward(q, k, v, _Ring(_resolve_group(group_name)), causal, layout, scale)


@_ring_attention_forward_op.register_fake
def _(q, k, v, group_name, causal, layout, scale, plan):
    batch, heads_q, local_len, _ = q.shape
    return q.new_empty(q.shape), q.new_empty((batch, heads_q, local_len), dtype=ACC_DTYPE)


@torch.library.custom_op("burstc::ring_attention_backward", mutates_args=())
@without_autocast
def _ring_attention_backward_op(grad_out: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor,
                                grad_lse: Tensor | None, group_name: str, causal: bool, layout: str, scale: float,
                                plan: str) -> tuple[Tensor, Tensor, Tensor]:
    ring = _Ring(_resolve_group(group_name))
    plan = resolve_plan(plan, q, k, ring.size)
    grad_out = grad_out.to(q.dtype).contiguous()
    lse = lse.to(ACC_DTYPE).contiguous()
    # An lse gradient g adds P * g to d(scores): the same as using delta - g (only delta changes).
    lse_has_grad = grad_lse is not None and bool(grad_lse.ne(0).any())
    recorder = _CallRecorder("backward", plan, ring, layout, causal, q, k)
    if plan == "burst":
        delta = attention_delta(out, grad_out)
        if lse_has_grad:
            delta = delta - grad_lse.to(ACC_DTYPE)
        grads = _burst_backward(grad_out, q, k, v, out, lse, delta.contiguous(), ring, causal, layout, scale,
                                recorder, out_is_consistent=not lse_has_grad)
    else:
        delta = attention_delta(out, grad_out) - grad_lse.to(ACC_DTYPE) if lse_has_grad else None
        grads = _kv_ring_backward(grad_out, q, k, v, out, lse, delta, ring, causal, layout, scale, recorder)
    recorder.publish()
    return tuple(g.contiguous() for g in grads)


@_ring_attention_backward_op.register_fake
def _(grad_out, q, k, v, out, lse, grad_lse, group_name, causal, layout, scale, plan):
    return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape)


def _setup_context(ctx, inputs, output):
    q, k, v, group_name, causal, layout, scale, plan = inputs
    out, lse = output
    ctx.save_for_backward(q, k, v, out, lse)
    ctx.config = (group_name, causal, layout, scale, plan)


def _backward(ctx, grad_out, grad_lse):
    q, k, v, out, lse = ctx.saved_tensors
    dq, dk, dv = torch.ops.burstc.ring_attention_backward(grad_out, q, k, v, out, lse, grad_lse, *ctx.config)
    return dq, dk, dv, None, None, None, None, None


_ring_attention_forward_op.register_autograd(_backward, setup_context=_setup_context)
# autocast runs SDPA in lower precision: so does the ring that replaces it (q, k, v cast alike)
register_lower_precision(_ring_attention_forward_op, (0, 1, 2))


# ---------------------------------------------------------------------------------------------
# Public API


def resolve_ring_group(group_or_mesh=None) -> dist.ProcessGroup:
    """A ProcessGroup, a 1-D DeviceMesh, or None (the default group) -> the ring's ProcessGroup."""
    if not (dist.is_available() and dist.is_initialized()):
        raise RuntimeError(
            "ring_attention needs an initialized torch.distributed process group: call "
            "dist.init_process_group(...) first (world size 1 is fine for single-process use)")
    if group_or_mesh is None:
        return dist.group.WORLD
    from torch.distributed.device_mesh import DeviceMesh

    if isinstance(group_or_mesh, DeviceMesh):
        if group_or_mesh.ndim != 1:
            raise ValueError(f"ring_attention needs a 1-D DeviceMesh, got {group_or_mesh.ndim}-D {group_or_mesh}")
        return group_or_mesh.get_group()
    if isinstance(group_or_mesh, dist.ProcessGroup):
        return group_or_mesh
    raise TypeError(f"group_or_mesh must be a ProcessGroup, a 1-D DeviceMesh or None, got {type(group_or_mesh)}")


def _check_inputs(q: Tensor, k: Tensor, v: Tensor, layout: str, plan: str) -> None:
    check_layout(layout)
    if plan not in PLAN_CHOICES:
        raise ValueError(f"plan must be one of {PLAN_CHOICES}, got {plan!r}")
    if q.dim() != 4 or k.dim() != 4 or v.dim() != 4:
        raise ValueError(f"q, k, v must be [B, H, S_local, D]; got shapes {tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}")
    if k.shape != v.shape:
        raise ValueError(f"k and v must have the same shape, got {tuple(k.shape)} and {tuple(v.shape)}")
    (batch, heads_q, local_len, head_dim), (batch_kv, heads_kv, local_len_kv, head_dim_kv) = q.shape, k.shape
    if (batch, local_len, head_dim) != (batch_kv, local_len_kv, head_dim_kv):
        raise ValueError(f"q {tuple(q.shape)} and k/v {tuple(k.shape)} must agree in B, S_local and D")
    if heads_q % heads_kv:
        raise ValueError(f"the number of query heads ({heads_q}) must be a multiple of the number of kv heads ({heads_kv})")
    if local_len < 1:
        raise ValueError("S_local must be at least 1")
    if layout == "zigzag" and local_len % 2:
        raise ValueError(f"layout 'zigzag' holds two equal chunks per rank, so S_local must be even, got {local_len}")
    if not (q.dtype == k.dtype == v.dtype) or q.dtype not in SUPPORTED_DTYPES:
        raise TypeError(f"q, k, v must share one dtype among {SUPPORTED_DTYPES}, got {q.dtype}, {k.dtype}, {v.dtype}")
    if not (q.device == k.device == v.device):
        raise ValueError(f"q, k, v must be on one device, got {q.device}, {k.device}, {v.device}")


def ring_attention_with_lse(q: Tensor, k: Tensor, v: Tensor, *, group_or_mesh=None, causal: bool = True,
                            layout: str = "zigzag", plan: str = "auto", scale: float | None = None
                            ) -> tuple[Tensor, Tensor]:
    """Ring attention over ``group_or_mesh``; returns ``(out [B, Hq, S_local, D] in q.dtype,
    lse [B, Hq, S_local] fp32)`` (natural log of the scaled scores).  Both are differentiable.

    q ``[B, Hq, S_local, D]``, k/v ``[B, Hkv, S_local, D]`` with ``Hq % Hkv == 0``, tokens in
    ``layout`` order (:func:`burstc.layout.local_positions`).  ``plan`` picks the backward
    (``"kv_ring"``, ``"burst"`` or ``"auto"``: the planner's cheaper one).
    """
    q, k, v = cast_like_lower_precision((q, k, v), q.device.type)  # as SDPA under torch.autocast
    _check_inputs(q, k, v, layout, plan)
    group = resolve_ring_group(group_or_mesh)
    scale = q.shape[-1] ** -0.5 if scale is None else float(scale)
    return torch.ops.burstc.ring_attention_forward(q, k, v, group.group_name, causal, layout, scale, plan)


def ring_attention(q: Tensor, k: Tensor, v: Tensor, *, group_or_mesh=None, causal: bool = True,
                   layout: str = "zigzag", plan: str = "auto", scale: float | None = None) -> Tensor:
    """Like :func:`ring_attention_with_lse`, returning only the output."""
    out, _ = ring_attention_with_lse(q, k, v, group_or_mesh=group_or_mesh, causal=causal, layout=layout,
                                     plan=plan, scale=scale)
    return out
