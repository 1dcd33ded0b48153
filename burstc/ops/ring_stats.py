"""Ring-attention counters: bytes handed to ``isend`` and score entries computed, per call, rank and step.

:func:`record_stats` collects one :class:`RingCallStats` per op call made inside its ``with`` block
(eager or compiled); the loops feed a :class:`CallRecorder`, which costs nothing when no recorder is
active.  The multi-rank tests compare these counters with the planner's byte formulas exactly.
"""
from __future__ import annotations

import contextlib
import dataclasses
from typing import TYPE_CHECKING, Iterator, Sequence

from torch import Tensor

if TYPE_CHECKING:
    from burstc.block_geometry import Block
    from burstc.ops.ring_comm import Ring


@dataclasses.dataclass
class RingCallStats:
    """One op call on one rank.

    ``work_per_step[i]``: unmasked score entries (B * Hq * allowed (query, key) pairs) computed at
    compute step ``i`` (``P`` entries; step ``i`` uses the block that started at rank - i).
    ``bytes_sent_per_step[i]``: bytes of every tensor handed to ``isend`` while step ``i`` is
    computed (posted before it, waited for after it).  The forward has ``P`` entries (the last is
    0: nothing left to send); the backward has ``P + 1``: the extra last entry is the hop that
    returns the travelling gradients (dK/dV or dQ) to their owners (``P + 2`` on a double ring: the last
    intra-node return, then the last lane's inter-node one).  Empty when P = 1.
    ``bytes_received_per_step[i]``: the same for the buffers handed to ``irecv``.
    """

    op: str                 # "forward" | "backward"
    plan: str | None        # resolved backward plan; None for the forward
    rank: int
    world_size: int
    layout: str
    mask: str               # MaskSpec.encode() of the call ("full", "causal", ...)
    shape: tuple[int, int, int, int, int]  # (B, Hq, Hkv, S_local, D)
    dtype: str
    bytes_sent_per_step: list[int]
    work_per_step: list[int]
    bytes_received_per_step: list[int] = dataclasses.field(default_factory=list)
    bytes_sent_by_link: dict[str, int] = dataclasses.field(default_factory=dict)
    """Bytes sent per link class: ``"ring"`` (a flat ring), or ``"intra"`` / ``"inter"`` (a double ring)."""

    @property
    def causal(self) -> bool:
        return self.mask == "causal"

    @property
    def total_bytes_sent(self) -> int:
        return sum(self.bytes_sent_per_step)

    @property
    def total_bytes_received(self) -> int:
        return sum(self.bytes_received_per_step)

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


class CallRecorder:
    """Per-call counters; publishes to the active recorders when the call finishes."""

    def __init__(self, op: str, plan: str | None, ring: "Ring", layout: str, mask: str, q: Tensor, k: Tensor):
        self.enabled = bool(_active_recorders)
        if not self.enabled:
            return
        batch, heads_q, local_len, head_dim = q.shape
        steps = ring.size + (ring.extra_backward_hops if op == "backward" else 0)
        self.stats = RingCallStats(
            op=op, plan=plan, rank=ring.rank, world_size=ring.size, layout=layout, mask=mask,
            shape=(batch, heads_q, k.shape[1], local_len, head_dim), dtype=str(q.dtype).removeprefix("torch."),
            bytes_sent_per_step=[0] * steps if ring.size > 1 else [], work_per_step=[0] * ring.size,
            bytes_received_per_step=[0] * steps if ring.size > 1 else [],
        )

    def sent(self, step: int, tensors: Sequence[Tensor], link: str = "ring") -> None:
        if self.enabled:
            nbytes = sum(t.numel() * t.element_size() for t in tensors)
            self.stats.bytes_sent_per_step[step] += nbytes
            self.stats.bytes_sent_by_link[link] = self.stats.bytes_sent_by_link.get(link, 0) + nbytes

    def received(self, step: int, tensors: Sequence[Tensor], link: str = "ring") -> None:
        if self.enabled:
            self.stats.bytes_received_per_step[step] += sum(t.numel() * t.element_size() for t in tensors)

    def computed(self, step: int, block: "Block", batch: int, heads_q: int, visible: int | None = None) -> None:
        """``visible``: the block's visible entries summed over the batch, when runtime mask data
        (documents, key padding) decide them; else the block's static count for every batch row."""
        if self.enabled:
            entries = batch * block.score_entries if visible is None else visible
            self.stats.work_per_step[step] += heads_q * entries

    def publish(self) -> None:
        if self.enabled:
            for recorder in _active_recorders:
                recorder.calls.append(self.stats)
