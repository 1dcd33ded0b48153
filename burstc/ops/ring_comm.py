"""Ring communication over ONE process group: neighbours, posting a step's transfers, double buffers.

A :class:`Ring` moves blocks to rank + 1 and receives from rank - 1 of its group.  It knows nothing
about attention, so that a two-level (inter/intra-node) ring can compose two of them later.
"""
from __future__ import annotations

from typing import Protocol, Sequence

import torch
import torch.distributed as dist
from torch import Tensor


class SendRecorder(Protocol):
    def sent(self, step: int, tensors: Sequence[Tensor]) -> None: ...


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
