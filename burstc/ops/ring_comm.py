"""Ring communication over ONE process group: neighbours, posting a step's transfers, double buffers.

A :class:`Ring` moves blocks between any two ranks of its group by offset (:meth:`Ring.post_between`: the
direct pattern of the mask-aware ring, where step t sends a rank's own block to rank + t).  It knows nothing about
attention, so that a two-level (inter/intra-node) ring can compose two of them later.

The recorder a step's transfers are posted with (:class:`burstc.ops.ring_stats.CallRecorder`) times them
from posting to the return of their wait, and opens their profiler spans while a trace is written.

Every wait is bounded: by the timeout ``burstc.compile(..., timeout=)`` set for the group
(:func:`set_wait_timeout`), else by the process group's own; a wait that fails raises
:class:`burstc.errors.PeerTimeout` / :class:`~burstc.errors.PeerFailure` naming the rank waited for.
"""
from __future__ import annotations

from typing import Callable, Protocol, Sequence

import torch.distributed as dist
from torch import Tensor

from burstc.block_geometry import GridPosition
from burstc.errors import wait_for_peer

# group name -> seconds every ring wait on that group may take; absent: the process group's own timeout
_WAIT_TIMEOUT_S: dict[str, float] = {}


def set_wait_timeout(group_name: str, seconds: float | None) -> None:
    """Bound every ring wait on the group ``group_name`` by ``seconds`` (``None``: the group's own timeout)."""
    if seconds is None:
        _WAIT_TIMEOUT_S.pop(group_name, None)
    else:
        _WAIT_TIMEOUT_S[group_name] = float(seconds)


def wait_timeout(group_name: str) -> float | None:
    """The bound :func:`set_wait_timeout` put on waits over ``group_name`` (None: the group's own timeout)."""
    return _WAIT_TIMEOUT_S.get(group_name)


# group name -> the name of a group over the same ranks whose own timeout is burstc's ``timeout=``: the loss and
# gradient all-reduces (functional collectives, waited by torch with the group's timeout) run on it
_REDUCTION_GROUPS: dict[str, str] = {}
_BOUNDED_GROUPS: dict[tuple, dist.ProcessGroup] = {}


def bound_reductions(group: dist.ProcessGroup, seconds: float | None) -> None:
    """Make the sum all-reduces that burstc inserts for ``group`` (:func:`reduction_group`) wait at most
    ``seconds`` for a peer (``None``: the group's own timeout).  Torch waits for a functional collective with
    its group's timeout, which a group can't change per call: a group over the same ranks with that timeout
    is created once (only those ranks call this: ``use_local_synchronization``) and used instead.  Sums don't
    depend on the ranks' order, so the new group's order doesn't matter."""
    if seconds is None:
        _REDUCTION_GROUPS.pop(group.group_name, None)
        return
    import datetime

    key = (group.group_name, float(seconds))  # per parent group: a group a timeout broke is not reused elsewhere
    if key not in _BOUNDED_GROUPS:
        _BOUNDED_GROUPS[key] = dist.new_group(dist.get_process_group_ranks(group), backend=dist.get_backend(group),
                                              timeout=datetime.timedelta(seconds=seconds),
                                              use_local_synchronization=True)
    _REDUCTION_GROUPS[group.group_name] = _BOUNDED_GROUPS[key].group_name


def reduction_group(group_name: str) -> str:
    """The group burstc's loss and gradient all-reduces over ``group_name`` run on (:func:`bound_reductions`)."""
    return _REDUCTION_GROUPS.get(group_name, group_name)


class SendRecorder(Protocol):
    def sent(self, step: int, tensors: Sequence[Tensor], link: str = "ring") -> None: ...

    def received(self, step: int, tensors: Sequence[Tensor], link: str = "ring") -> None: ...

    def posting(self, step: int, describe: Callable[[], list[tuple[str, int, int, int]]]):
        """A context manager around posting a step's transfers, ``describe()``: ``(direction, global peer, bytes,
        requests)`` each (called only when recorded); it gives what :func:`wait` reports to (``waiting()``,
        ``request_done(i)``, ``waited()``), or None."""


def resolve_group(group_name: str) -> dist.ProcessGroup:
    """The process group registered under ``group_name`` (what custom ops receive)."""
    from torch.distributed.distributed_c10d import _resolve_process_group

    return _resolve_process_group(group_name)


class Ring:
    """This rank in a 1-D group: posts the transfers of one step to and from ranks at given offsets."""

    timeout_s: float | None = None  # bound on each wait (set_wait_timeout); None: the group's own timeout
    extra_backward_hops = 1  # the backward's last gradients return in one hop after the last compute step
    link = "ring"  # the link class its bytes are counted under: "ring" (flat), "intra" or "inter"

    def __init__(self, group: dist.ProcessGroup, link: str = "ring"):
        self.group = group
        self.link = link
        self.size = group.size()
        self.rank = group.rank()
        self.timeout_s = wait_timeout(group.group_name)

    def peer(self, offset: int) -> int:
        """The global rank of group rank ``rank + offset`` (mod the group size)."""
        return dist.get_global_rank(self.group, (self.rank + offset) % self.size)

    def post_between(self, sends: Sequence[tuple[int, Sequence[Tensor]]],
                     recvs: Sequence[tuple[int, Sequence[Tensor]]], recorder: SendRecorder, step: int) -> list:
        """Start each ``(offset, tensors)`` of ``sends`` towards group rank ``rank + offset`` and each
        of ``recvs`` from group rank ``rank + offset``; ``recorder`` counts both as ``step``'s.  Two
        messages between the same two ranks in one call match in list order, so both sides list their
        kinds of message in the same order.  Receives first: with gloo, a send-first list makes one
        direction wait behind the other's data (measured 2x slower per step on a rate-limited link).  Returns the requests
        to :func:`wait` for (none when both lists are empty)."""
        ops = [dist.P2POp(dist.irecv, t, self.peer(offset), self.group) for offset, tensors in recvs for t in tensors]
        ops += [dist.P2POp(dist.isend, t, self.peer(offset), self.group) for offset, tensors in sends for t in tensors]
        for _, tensors in sends:
            recorder.sent(step, tensors, self.link)
        for _, tensors in recvs:
            recorder.received(step, tensors, self.link)
        if not ops:
            return []
        peers = [("receive from", self.peer(offset)) for offset, tensors in recvs for _ in tensors]
        peers += [("send to", self.peer(offset)) for offset, tensors in sends for _ in tensors]
        with recorder.posting(step, lambda: self._transfers(recvs, sends)) as posted:
            requests = dist.batch_isend_irecv(ops)
        return _Posted(requests, peers, self.timeout_s, posted)

    def _transfers(self, recvs, sends) -> list[tuple[str, int, int, int]]:
        """``(direction, global peer, bytes, requests)`` of each message group, in request order."""
        return [(direction, self.peer(offset), sum(t.numel() * t.element_size() for t in tensors), len(tensors))
                for direction, groups in (("recv", recvs), ("send", sends)) for offset, tensors in groups if tensors]


class TwoLevelRing:
    """This rank in a nodes x ranks-per-node sequence-parallel mesh: an ``inter`` :class:`Ring` over the
    ranks with this rank's local index on every node (its lane) and an ``intra`` one over this node's
    ranks.  The sequence order is node-major: this rank is ``node * per_node + local`` of ``size``,
    the order of the flattened mesh that shards the tokens (``DeviceMesh._flatten``)."""

    extra_backward_hops = 2  # the last intra-node gradient return, then the last lane's inter-node one

    def __init__(self, inter: dist.ProcessGroup, intra: dist.ProcessGroup):
        self.inter, self.intra = Ring(inter, link="inter"), Ring(intra, link="intra")
        self.nodes, self.per_node = self.inter.size, self.intra.size
        self.node, self.local = self.inter.rank, self.intra.rank
        self.size = self.nodes * self.per_node
        self.rank = self.node * self.per_node + self.local
        self.position = GridPosition(self.nodes, self.per_node, self.rank)

    def seq_rank(self, node_offset: int, local_offset: int) -> int:
        """The sequence rank of (this node + ``node_offset``, this local index + ``local_offset``)."""
        return self.position.seq_rank(node_offset, local_offset)


class UlyssesRing:
    """This rank in a nodes x ranks-per-node mesh running the hybrid (:mod:`burstc.ops.ulysses`): all-to-all
    over ``intra`` (this node's ranks), a flat :class:`Ring` over ``inter`` (this rank's lane)."""

    ULYSSES = "ulysses"  # the first of the op's group names marks the hybrid: ["ulysses", intra, inter]

    def __init__(self, intra: dist.ProcessGroup, inter: dist.ProcessGroup):
        self.intra, self.inter = intra, Ring(inter, link="inter")
        self.nodes, self.per_node = self.inter.size, intra.size()
        self.node, self.local = self.inter.rank, intra.rank()
        self.size = self.nodes * self.per_node
        self.rank = self.node * self.per_node + self.local


class _Posted(list):
    """A step's requests, with the peer of each, the ring's wait timeout and the recorder's record of the
    posting (for :func:`wait`)."""

    def __init__(self, requests, peers, timeout_s: float | None, posted=None):
        super().__init__(requests)
        self.peers = peers if len(peers) == len(self) else [("exchange with", None)] * len(self)
        self.timeout_s = timeout_s
        self.posted = posted


def wait(requests) -> None:
    timeout_s = getattr(requests, "timeout_s", None)
    peers = getattr(requests, "peers", None) or [("exchange with", None)] * len(requests)
    posted = getattr(requests, "posted", None)
    if posted is not None:
        posted.waiting()
    for index, (request, (what, peer)) in enumerate(zip(requests, peers)):
        who = f"rank {peer}" if peer is not None else "a peer rank"
        wait_for_peer(request, timeout_s, f"burstc ring attention: rank {dist.get_rank()} waited to {what} {who}",
                      f"Is {who} alive and calling the compiled model?")
        if posted is not None:
            posted.request_done(index)
    if posted is not None:
        posted.waited()
