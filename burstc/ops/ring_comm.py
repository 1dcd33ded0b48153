"""Ring communication over ONE process group: neighbours, posting a step's transfers, double buffers.

A :class:`Ring` moves blocks to rank + 1 and receives from rank - 1 of its group (:meth:`Ring.post`),
or between any two ranks of the group by offset (:meth:`Ring.post_between`: the direct pattern of the
mask-aware ring, where step t sends a rank's own block to rank + t).  It knows nothing about
attention, so that a two-level (inter/intra-node) ring can compose two of them later.
"""
from __future__ import annotations

from typing import Protocol, Sequence

import torch
import torch.distributed as dist
from torch import Tensor


class SendRecorder(Protocol):
    def sent(self, step: int, tensors: Sequence[Tensor]) -> None: ...

    def received(self, step: int, tensors: Sequence[Tensor]) -> None: ...


def resolve_group(group_name: str) -> dist.ProcessGroup:
    """The process group registered under ``group_name`` (what custom ops receive)."""
    from torch.distributed.distributed_c10d import _resolve_process_group

    return _resolve_process_group(group_name)


class Ring:
    """Neighbours of this rank in a 1-D group: blocks move to rank + 1 and arrive from rank - 1."""

    def __init__(self, group: dist.ProcessGroup):
        self.group = group
        self.size = group.size()
        self.rank = group.rank()
        self.next_peer = dist.get_global_rank(group, (self.rank + 1) % self.size)
        self.prev_peer = dist.get_global_rank(group, (self.rank - 1) % self.size)

    def post(self, sends: Sequence[Tensor], recvs: Sequence[Tensor], recorder: SendRecorder, step: int) -> list:
        """Start sending ``sends`` to the next rank and receiving ``recvs`` (same shapes, same order
        on every rank) from the previous one; ``recorder`` counts the sent bytes as ``step``'s.
        Returns the requests to :func:`wait` for."""
        if not sends:
            return []
        # Receives first: with gloo, a send-first list makes one direction wait behind the other's
        # data (measured 2x slower per step on a rate-limited link).
        ops = [dist.P2POp(dist.irecv, t, self.prev_peer, self.group) for t in recvs]
        ops += [dist.P2POp(dist.isend, t, self.next_peer, self.group) for t in sends]
        recorder.sent(step, sends)
        return dist.batch_isend_irecv(ops)

    def peer(self, offset: int) -> int:
        """The global rank of group rank ``rank + offset`` (mod the group size)."""
        return dist.get_global_rank(self.group, (self.rank + offset) % self.size)

    def post_between(self, sends: Sequence[tuple[int, Sequence[Tensor]]],
                     recvs: Sequence[tuple[int, Sequence[Tensor]]], recorder: SendRecorder, step: int) -> list:
        """Start each ``(offset, tensors)`` of ``sends`` towards group rank ``rank + offset`` and each
        of ``recvs`` from group rank ``rank + offset``; ``recorder`` counts both as ``step``'s.  Two
        messages between the same two ranks in one call match in list order, so both sides list their
        kinds of message in the same order.  Receives first (see :meth:`post`).  Returns the requests
        to :func:`wait` for (none when both lists are empty)."""
        ops = [dist.P2POp(dist.irecv, t, self.peer(offset), self.group) for offset, tensors in recvs for t in tensors]
        ops += [dist.P2POp(dist.isend, t, self.peer(offset), self.group) for offset, tensors in sends for t in tensors]
        for _, tensors in sends:
            recorder.sent(step, tensors)
        for _, tensors in recvs:
            recorder.received(step, tensors)
        return dist.batch_isend_irecv(ops) if ops else []


def wait(requests) -> None:
    for request in requests:
        request.wait()


class DoubleBuffer:
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
