"""Ring-attention counters: bytes handed to ``isend``, score entries computed and the time transfers took
and stayed hidden behind compute, per call, rank and step; and the profiler spans of a trace.

:func:`record_stats` collects one :class:`RingCallStats` per op call made inside its ``with`` block
(eager or compiled); the loops feed a :class:`CallRecorder`, which costs nothing when no recorder is
active and no trace is being written (:mod:`burstc.timeline`).  The multi-rank tests compare these
counters with the planner's byte formulas exactly.

Timing (host clock, ``time.perf_counter``): a step's transfers run from the moment they are posted to
the moment their wait returns (a transfer that finished earlier is seen finishing when waited for);
the part of that interval during which the rank computed a ring step is *hidden*; the time spent in the
calls that post the transfers and wait for them is *exposed*.  ``overlap = hidden / transfer``.  On CUDA
the host clock sees the host side only (a wait that orders streams returns at once).
"""
from __future__ import annotations

import contextlib
import dataclasses
import time
from typing import TYPE_CHECKING, Callable, Iterator, Sequence

from torch import Tensor
from torch.autograd.profiler import record_function

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
    ``transfer_s_per_step[i]``, ``hidden_s_per_step[i]``, ``exposed_s_per_step[i]``: seconds from posting
    step ``i``'s transfers to their wait's return (a step posted in parts: the union of the parts' intervals), the
    part of it spent computing ring steps or away (:meth:`CallRecorder.leave`), the time spent posting and waiting
    for them (exposed; module docstring); 0 for a step that moved nothing.
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
    transfer_s_per_step: list[float] = dataclasses.field(default_factory=list)
    hidden_s_per_step: list[float] = dataclasses.field(default_factory=list)
    exposed_s_per_step: list[float] = dataclasses.field(default_factory=list)
    kernel_entries_per_step: list[int] = dataclasses.field(default_factory=list)
    """Score entries the kernels evaluated at each compute step (B * Hq * each block's rectangle, a top-left causal
    block's triangle): ``work_per_step`` plus the hidden entries inside computed blocks."""
    wall_s: float = 0.0
    """Seconds from the call's start (its recorder's creation) to its end (publication), less ``away_s``."""
    away_s: float = 0.0
    """Seconds the call left to the graph's other work: a split backward's time between its start and its finish
    (``overlap_ring_backward`` pass), during which its last hop travels; that time counts as hiding the hop."""
    compute_s: float = 0.0
    """Seconds of those spent in the compute steps (the block kernels and their merges)."""
    batch_groups: int = 1
    """Groups of batch rows the call ran as, one ring loop each (:mod:`burstc.ops.batch_groups`: key padding whose
    rows disagree); decided per call from the padding."""
    head_groups: int = 1
    """Head groups each batch group ran as (:mod:`burstc.ops.head_groups`; the most over the batch groups)."""

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

    @property
    def transfer_s(self) -> float:
        return sum(self.transfer_s_per_step)

    @property
    def hidden_s(self) -> float:
        return sum(self.hidden_s_per_step)

    @property
    def exposed_s(self) -> float:
        return sum(self.exposed_s_per_step)

    @property
    def overlap(self) -> float | None:
        """The fraction of transfer time hidden behind compute; None when nothing moved."""
        return _fraction(self.hidden_s, self.transfer_s)


def _fraction(hidden_s: float, transfer_s: float) -> float | None:
    return min(1.0, hidden_s / transfer_s) if transfer_s > 0 else None


@dataclasses.dataclass
class RingStats:
    """Collected by :func:`record_stats`; ``calls`` in call order (this process = one rank)."""

    calls: list[RingCallStats] = dataclasses.field(default_factory=list)

    def of(self, op: str) -> list[RingCallStats]:
        return [c for c in self.calls if c.op == op]

    @property
    def bytes_sent_by_link(self) -> dict[str, int]:
        """Bytes sent per link class over every call."""
        links: dict[str, int] = {}
        for call in self.calls:
            for link, nbytes in call.bytes_sent_by_link.items():
                links[link] = links.get(link, 0) + nbytes
        return links

    @property
    def transfer_s(self) -> float:
        return sum(c.transfer_s for c in self.calls)

    @property
    def hidden_s(self) -> float:
        return sum(c.hidden_s for c in self.calls)

    @property
    def exposed_s(self) -> float:
        return sum(c.exposed_s for c in self.calls)

    @property
    def overlap(self) -> float | None:
        """Over every call: the fraction of transfer time hidden behind compute; None when nothing moved."""
        return _fraction(self.hidden_s, self.transfer_s)


_active_recorders: list[RingStats] = []
_spans_on = False  # a trace is being written (burstc.timeline): the loops open profiler spans


def start_recording() -> RingStats:
    """Start recording every ring-attention call into a new :class:`RingStats` (:func:`stop_recording` ends it)."""
    stats = RingStats()
    _active_recorders.append(stats)
    return stats


def stop_recording(stats: RingStats) -> None:
    if stats in _active_recorders:
        _active_recorders.remove(stats)


@contextlib.contextmanager
def record_stats() -> Iterator[RingStats]:
    """Record every ring-attention call (eager or compiled) made inside the ``with`` block."""
    stats = start_recording()
    try:
        yield stats
    finally:
        stop_recording(stats)


def set_trace_spans(on: bool) -> None:
    """Have ring calls that start from now on open profiler spans (``True`` only while a profiler runs)."""
    global _spans_on
    _spans_on = bool(on)


_NOTHING = contextlib.nullcontext()  # what step() and posting() give when nothing is recorded or traced

# span name -> the trace event's args (peer, bytes, direction, ...), for burstc.timeline's export
SPAN_ARGS: dict[str, dict] = {}


class _Span:
    """A profiler span (``record_function``) from construction to :meth:`close`."""

    __slots__ = ("_span",)

    def __init__(self, name: str, args: dict):
        SPAN_ARGS.setdefault(name, args)
        self._span = record_function(name)
        self._span.__enter__()

    def close(self) -> None:
        if self._span is not None:
            self._span.__exit__(None, None, None)
            self._span = None


def _overlap_s(start: float, stop: float, intervals: Sequence[tuple[float, float]]) -> float:
    """Seconds of ``[start, stop]`` covered by the disjoint ``intervals``."""
    return sum(max(0.0, min(stop, b) - max(start, a)) for a, b in intervals)


def _uncovered(start: float, stop: float, covered: Sequence[tuple[float, float]]) -> list[tuple[float, float]]:
    """The parts of ``[start, stop]`` outside every interval of ``covered`` (which may overlap), as disjoint
    intervals in order."""
    parts = []
    for a, b in sorted(covered):
        if a >= stop:
            break
        if a > start:
            parts.append((start, a))
        start = max(start, b)
        if start >= stop:
            return parts
    return parts + [(start, stop)]


class CallRecorder:
    """Per-call counters and timers; publishes to the active recorders when the call finishes.  While a trace
    is written it also opens the profiler spans: each compute step (:meth:`step`), each transfer and each
    wait (:meth:`posting`, for :mod:`burstc.ops.ring_comm`)."""

    def __init__(self, op: str, plan: str | None, ring: "Ring", layout: str, mask: str, q: Tensor, k: Tensor):
        self.enabled = bool(_active_recorders)
        self.spans = _spans_on
        if not (self.enabled or self.spans):
            return
        self.tag = "fwd" if op == "forward" else "bwd"
        self.computing: list[tuple[float, float]] = []  # (start, stop) of each compute step so far
        self.away: list[tuple[float, float]] = []  # (left, back) of each time the call left the thread (leave())
        # step -> (posted, waited) of each of its postings: a step posted in parts (a prefetched first transfer, the
        # double ring's lane and intra-node transfers) counts the union of their intervals once
        self.transfer_spans: dict[int, list[tuple[float, float]]] = {}
        if not self.enabled:
            return
        self.started = time.perf_counter()
        batch, heads_q, local_len, head_dim = q.shape
        steps = ring.size + (ring.extra_backward_hops if op == "backward" else 0)
        per_step = (lambda zero: [zero] * steps) if ring.size > 1 else (lambda zero: [])
        self.stats = RingCallStats(
            op=op, plan=plan, rank=ring.rank, world_size=ring.size, layout=getattr(layout, "name", layout), mask=mask,
            shape=(batch, heads_q, k.shape[1], local_len, head_dim), dtype=str(q.dtype).removeprefix("torch."),
            bytes_sent_per_step=per_step(0), work_per_step=[0] * ring.size, bytes_received_per_step=per_step(0),
            kernel_entries_per_step=[0] * ring.size,
            transfer_s_per_step=per_step(0.0), hidden_s_per_step=per_step(0.0), exposed_s_per_step=per_step(0.0),
        )

    def step(self, step: int, q_owner: int, kv_owner: int):
        """Around compute step ``step``, which attends the queries of group rank ``q_owner`` to the keys of
        ``kv_owner``: its time, and a ``ring fwd|bwd step t`` span while tracing; else nothing."""
        if not (self.enabled or self.spans):
            return _NOTHING
        return _ComputeStep(self, step, q_owner, kv_owner)

    def posting(self, step: int, describe: Callable[[], Sequence[tuple[str, int, int, int]]]):
        """Around posting step ``step``'s transfers, ``describe()``: ``(direction "send"|"recv", global peer rank,
        bytes, requests)`` in request order.  Gives what :func:`burstc.ops.ring_comm.wait` reports to (None when
        off: then ``describe`` is not called)."""
        if not (self.enabled or self.spans):
            return _NOTHING
        return _Transfers(self, step, describe())

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
            self.stats.kernel_entries_per_step[step] += heads_q * batch * block.kernel_entries

    def split(self, batch_groups: int, head_groups: int) -> None:
        """The call runs as ``batch_groups`` x (up to) ``head_groups`` ring loops."""
        if self.enabled:
            self.stats.batch_groups, self.stats.head_groups = batch_groups, head_groups

    def leave(self) -> Callable[[], None]:
        """The call hands the thread to the graph's other work until the returned function is called (a split
        backward between its start and finish): that time is not the call's, and it hides the call's transfers
        in flight as its own compute would."""
        if not (self.enabled or self.spans):
            return _back_at_once
        left = time.perf_counter()
        return lambda: self.away.append((left, time.perf_counter()))

    def publish(self) -> None:
        if self.enabled:
            self.stats.away_s = sum(back - left for left, back in self.away)
            self.stats.wall_s = time.perf_counter() - self.started - self.stats.away_s
            self.stats.compute_s = sum(stop - start for start, stop in self.computing)
            for recorder in _active_recorders:
                recorder.calls.append(self.stats)


def _back_at_once() -> None:
    return None


class _ComputeStep:
    def __init__(self, recorder: CallRecorder, step: int, q_owner: int, kv_owner: int):
        self.recorder, self.step, self.pair = recorder, step, (q_owner, kv_owner)

    def __enter__(self):
        recorder = self.recorder
        self.span = None
        if recorder.spans:
            # sequence ranks (a rank's place in the sequence-parallel group; the global rank on a 1-D world
            # mesh): every ring kind knows them, and they name the blocks a step attends
            q_rank, kv_rank = self.pair
            self.span = _Span(f"ring {recorder.tag} step {self.step} (q rank {q_rank}, kv rank {kv_rank})",
                              dict(kind="compute", op=recorder.tag, step=self.step, q_rank=q_rank, kv_rank=kv_rank))
        self.start = time.perf_counter()
        return self

    def __exit__(self, *exc_info):
        self.recorder.computing.append((self.start, time.perf_counter()))
        if self.span is not None:
            self.span.close()


class _Transfers:
    """One step's transfers: a span per (direction, peer) from posting to the wait of its last request,
    ``ring fwd|bwd post step t`` and ``ring fwd|bwd wait step t`` spans around the calls that post and wait
    for them, and the step's transfer, hidden and exposed seconds (exposed: the time spent in those calls)."""

    def __init__(self, recorder: CallRecorder, step: int, transfers: Sequence[tuple[str, int, int, int]]):
        self.recorder, self.step = recorder, step
        self.spans: list[_Span] = []
        self.last_request: dict[int, int] = {}  # index of a transfer's last request -> index of the transfer
        first = 0
        for index, (direction, peer, nbytes, requests) in enumerate(transfers):
            self.last_request[first + requests - 1] = index
            first += requests
            if recorder.spans:
                where = "to" if direction == "send" else "from"
                self.spans.append(_Span(
                    f"ring {recorder.tag} {direction} step {step} {where} rank {peer} ({nbytes} B)",
                    dict(kind="transfer", op=recorder.tag, step=step, direction=direction, peer=peer, bytes=nbytes)))
        self.posted = time.perf_counter()

    def __enter__(self) -> "_Transfers":
        self.call_span = self._call_span("post")
        return self

    def __exit__(self, *exc_info) -> None:
        self.post_s = time.perf_counter() - self.posted
        if self.call_span is not None:
            self.call_span.close()

    def _call_span(self, call: str) -> "_Span | None":
        if not self.recorder.spans:
            return None
        tag = self.recorder.tag
        return _Span(f"ring {tag} {call} step {self.step}", dict(kind=call, op=tag, step=self.step))

    def waiting(self) -> None:
        """The wait starts."""
        self.wait_start = time.perf_counter()
        self.call_span = self._call_span("wait")

    def request_done(self, index: int) -> None:
        """Request ``index`` (in posting order) has been waited for."""
        transfer = self.last_request.get(index)
        if transfer is not None and self.spans:
            self.spans[transfer].close()

    def waited(self) -> None:
        """Every request has been waited for."""
        end = time.perf_counter()
        if self.call_span is not None:
            self.call_span.close()
        recorder = self.recorder
        if recorder.enabled:
            stats = recorder.stats
            spans = recorder.transfer_spans.setdefault(self.step, [])
            for start, stop in _uncovered(self.posted, end, spans):
                stats.transfer_s_per_step[self.step] += stop - start
                stats.hidden_s_per_step[self.step] += (_overlap_s(start, stop, recorder.computing)
                                                        + _overlap_s(start, stop, recorder.away))
            spans.append((self.posted, end))
            stats.exposed_s_per_step[self.step] += self.post_s + end - self.wait_start
