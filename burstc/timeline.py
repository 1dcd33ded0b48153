"""Traces you can open in Perfetto (https://ui.perfetto.dev) or ``chrome://tracing``: one JSON file per rank.

Two ways to choose what is traced:

* ``burstc.trace(dir)``: a ``with`` block, e.g. around one training step (forward, backward, optimizer step);
  every rank writes ``dir/rank{R}.json`` when the block ends (the same name again overwrites it).
* ``burstc.compile(..., trace=dir)`` or ``BURSTC_TRACE=dir``: every call of the compiled model but the first
  (which compiles) is traced, from the call to the model's next call (one training step: forward, backward,
  optimizer step), or to :func:`flush` or the process's exit for the last one; each writes
  ``dir/rank{R}-call{N}.json`` (N = 1 for the second call) when its window ends.  Meant for a few steps: a
  trace holds every op the profiler saw.  A call made while a profiler already runs is not traced.

A trace is ``torch.profiler``'s (CPU activities, and CUDA where available) with burstc's spans:
``ring fwd step t (q rank i, kv rank j)`` / ``ring bwd step t (...)`` around each ring step's compute (i, j:
sequence ranks, the blocks' owners in the sequence-parallel group),
``ring fwd|bwd post step t`` and ``ring fwd|bwd wait step t`` around the calls that post the step's
transfers and wait for them (the exposed communication), on the rank's thread; and one span per transfer,
``ring fwd|bwd send step t to rank j (n B)`` / ``... recv step t from rank j (n B)``, from posting to the
return of its wait, moved to tracks of their own (``ring sends to rank j``, ``ring receives from rank j``)
so that they do not cross the compute spans.  Every span's ``args`` hold its kind, op and step, and a
transfer's the peer, the bytes and the direction.  The window's ring calls are recorded too (:class:`TraceWindow`: the
overlap fraction, also in ``burstc.report(model)`` when the window belongs to a model).  With no trace
active, no profiler runs and the ring loops open no spans.
"""
from __future__ import annotations

import atexit
import contextlib
import itertools
import json
import os
from pathlib import Path
from typing import Iterator

import torch

from burstc.ops import ring_stats

_TRANSFER_TRACKS = 1_000_000_000  # thread ids of the transfer tracks (above any Linux thread id)
_current: "TraceWindow | None" = None  # the window being traced in this process


def _rank() -> int:
    import torch.distributed as dist

    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


class TraceWindow:
    """One traced window on this rank: its trace file, the ring calls made in it (``stats``, a
    :class:`burstc.ops.ring_stats.RingStats`) and their overlap fraction."""

    def __init__(self, directory, file_name: str, report=None, call: int | None = None):
        self.path = Path(directory) / file_name
        self.rank = _rank()
        self.call = call  # the traced call of the model (the trace= option), else None
        self.stats: ring_stats.RingStats | None = None
        self._report = report
        self._profiler = None

    @property
    def overlap(self) -> float | None:
        """The fraction of the window's ring transfer time hidden behind ring compute (None: nothing moved)."""
        return self.stats.overlap

    def __str__(self) -> str:
        stats = self.stats
        where = f"call {self.call}, rank {self.rank}" if self.call is not None else f"rank {self.rank}"
        if stats is None or stats.overlap is None:
            return f"trace of {where}: no ring transfers -> {self.path}"
        grouped = sum(1 for call in stats.calls if call.batch_groups > 1)
        split = f" ({grouped} as batch groups)" if grouped else ""
        return (f"trace of {where}: {len(stats.calls)} ring call(s){split}, transfers {stats.transfer_s:.3f} s, hidden "
                f"{stats.hidden_s:.3f} s, exposed {stats.exposed_s:.3f} s: overlap {stats.overlap:.2f} -> {self.path}")

    def open(self) -> None:
        global _current
        if _current is not None:
            raise RuntimeError(f"burstc: a trace is already being written ({_current.path}); one at a time")
        self.path.parent.mkdir(parents=True, exist_ok=True)
        activities = [torch.profiler.ProfilerActivity.CPU]
        if torch.cuda.is_available():
            activities.append(torch.profiler.ProfilerActivity.CUDA)
        self._profiler = torch.profiler.profile(activities=activities)
        self._profiler.start()
        _current = self
        self.stats = ring_stats.start_recording()
        ring_stats.set_trace_spans(True)

    def close(self) -> None:
        """Stop the profiler, write the trace, and add the window to its report.  Idempotent."""
        global _current
        if _current is not self:
            return
        _current = None
        ring_stats.set_trace_spans(False)
        ring_stats.stop_recording(self.stats)
        profiler, self._profiler = self._profiler, None
        profiler.stop()
        profiler.export_chrome_trace(str(self.path))
        _arrange(self.path, self.rank)
        ring_stats.SPAN_ARGS.clear()
        if self._report is not None:
            self._report.traces.append(self)


def _arrange(path: Path, rank: int) -> None:
    """Move burstc's transfer spans to one track per (direction, peer), give them their args, and name the
    process after the rank."""
    trace = json.loads(path.read_text())
    events = trace["traceEvents"]
    tracks: dict[tuple[int, str, int], int] = {}
    for event in events:
        # host spans only (on CUDA the profiler mirrors user annotations onto the streams as gpu_user_annotation)
        args = ring_stats.SPAN_ARGS.get(event.get("name")) if event.get("cat") == "user_annotation" else None
        if args is None:
            continue
        event.setdefault("args", {}).update(args)
        if args["kind"] == "transfer":
            key = (event["pid"], args["direction"], args["peer"])
            event["tid"] = tracks.setdefault(key, _TRANSFER_TRACKS + 2 * args["peer"] + (args["direction"] == "recv"))
    for (pid, direction, peer), tid in sorted(tracks.items(), key=lambda item: item[1]):
        name = f"ring sends to rank {peer}" if direction == "send" else f"ring receives from rank {peer}"
        events.append({"ph": "M", "name": "thread_name", "pid": pid, "tid": tid, "args": {"name": name}})
        events.append({"ph": "M", "name": "thread_sort_index", "pid": pid, "tid": tid, "args": {"sort_index": tid}})
    for event in events:  # this process's track (not a GPU's)
        if event.get("ph") == "M" and event.get("name") == "process_name" and event.get("pid") == os.getpid():
            event["args"] = {"name": f"rank {rank}"}
    path.write_text(json.dumps(trace))


@contextlib.contextmanager
def trace(directory, *, model=None) -> Iterator[TraceWindow]:
    """Trace the ``with`` block into ``directory/rank{R}.json`` (every rank its own); yields the
    :class:`TraceWindow`, whose ``overlap`` is the measured fraction after the block.  ``model``: a model
    from :func:`burstc.compile`, whose report then lists the window."""
    report = None
    if model is not None:
        from burstc.api import report_of

        report = report_of(model)
    flush()
    window = TraceWindow(directory, f"rank{_rank()}.json", report)
    window.open()
    try:
        yield window
    finally:
        window.close()


# -- the trace= option: a window per call ------------------------------------------------------------------


def trace_calls(compiled, directory, report):
    """``compiled`` (what :func:`burstc.compile` returns) with every call after its first traced into
    ``directory`` (see the module docstring)."""
    calls = itertools.count()

    def traced(call, *args, **kwargs):
        index = next(calls)
        flush()  # the previous traced call's window ends where this call starts
        # the first call compiles; a burstc.trace block (or a profiler of the user's) covers this one
        if index == 0 or _current is not None or torch.autograd._profiler_enabled():
            return call(*args, **kwargs)
        window = TraceWindow(directory, f"rank{_rank()}-call{index}.json", report, call=index)
        window.open()
        try:
            return call(*args, **kwargs)
        except BaseException:
            window.close()
            raise

    if isinstance(compiled, torch.nn.Module):
        forward = compiled.forward
        compiled.forward = lambda *args, **kwargs: traced(forward, *args, **kwargs)
        return compiled

    def traced_function(*args, **kwargs):
        return traced(compiled, *args, **kwargs)

    traced_function.__dict__.update(compiled.__dict__)
    return traced_function


def flush() -> None:
    """End the window of the last traced call now and write its file (else the model's next call or the
    process's exit does).  The profiler can't be stopped from autograd's end-of-backward callback: the engine
    restores the caller's profiler state after it."""
    if _current is not None and _current.call is not None:
        _current.close()


atexit.register(flush)
