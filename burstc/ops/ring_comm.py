"""Ring communication over ONE process group: neighbours, posting a step's transfers, double buffers.

A :class:`Ring` moves blocks to rank + 1 and receives from rank - 1 of its group.  It knows nothing
about attention, so that a two-level (inter/intra-node) ring can compose two of them later.

Every wait is bounded: by the timeout ``burstc.compile(..., timeout=)`` set for the group
(:func:`set_wait_timeout`), else by the process group's own; a wait that fails raises
:class:`burstc.errors.PeerTimeout` / :class:`~burstc.errors.PeerFailure` naming the rank waited for.
"""
from __future__ import annotations

from typing import Protocol, Sequence

import torch
import torch.distributed as dist
from torch import Tensor

from burstc.errors import wait_for_peer

# group name -> seconds every ring wait on that group may take; absent: the process group's own timeout
_WAIT_TIMEOUT_S: dict[str, float] = {}


def set_wait_timeout(group_name: str, seconds: float | None) -> None:
    """Bound every ring wait on the group ``group_name`` by ``seconds`` (``None``: the group's own timeout)."""
    if seconds is None:
        _WAIT_TIMEOUT_S.pop(group_name, None)
    else:
        _WAIT_TIMEOUT_S[group_name] = float(seconds)


class SendRecorder(Protocol):
    def sent(self, step: int, tensors: Sequence[Tensor]) -> None: ...


def resolve_group(group_name: str) -> dist.ProcessGroup:
    """The process group registered under ``group_name`` (what custom ops receive)."""
    from torch.distributed.distributed_c10d import _resolve_process_group

    return _resolve_process_group(group_name)


class Ring:
    """Neighbours of this rank in a 1-D group: blocks move to rank + 1 and arrive from rank - 1."""

    timeout_s: float | None = None  # bound on each wait (set_wait_timeout); None: the group's own timeout

    def __init__(self, group: dist.ProcessGroup):
        self.group = group
        self.size = group.size()
        self.rank = group.rank()
        self.next_peer = dist.get_global_rank(group, (self.rank + 1) % self.size)
        self.prev_peer = dist.get_global_rank(group, (self.rank - 1) % self.size)
        self.timeout_s = _WAIT_TIMEOUT_S.get(group.group_name)

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
        peers = [("receive from", self.prev_peer)] * len(recvs) + [("send to", self.next_peer)] * len(sends)
        return _Posted(dist.batch_isend_irecv(ops), peers, self.timeout_s)


class _Posted(list):
    """A step's requests, with the peer of each and the ring's wait timeout (for :func:`wait`)."""

    def __init__(self, requests, peers, timeout_s: float | None):
        super().__init__(requests)
        self.peers = peers if len(peers) == len(self) else [("exchange with", None)] * len(self)
        self.timeout_s = timeout_s


def wait(requests) -> None:
    timeout_s = getattr(requests, "timeout_s", None)
    peers = getattr(requests, "peers", None) or [("exchange with", None)] * len(requests)
    for request, (what, peer) in zip(requests, peers):
        who = f"rank {peer}" if peer is not None else "a peer rank"
        wait_for_peer(request, timeout_s, f"burstc ring attention: rank {dist.get_rank()} waited to {what} {who}",
                      f"Is {who} alive and calling the compiled model?")


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
