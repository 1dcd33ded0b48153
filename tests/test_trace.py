"""Traces (burstc.timeline): one Perfetto/Chrome JSON file per rank naming every ring step of the forward and the
backward and every transfer with its peer; the measured overlap fraction; nothing at all when tracing is off."""
from __future__ import annotations

import collections
import json
import os
import re
import types
from pathlib import Path

import pytest
import torch

import burstc
from burstc import timeline
from burstc.config import BurstConfig
from burstc.ops import ring_stats

STEP = re.compile(r"ring (fwd|bwd) step (\d+) \(q rank (\d+), kv rank (\d+)\)$")
TRANSFER = re.compile(r"ring (fwd|bwd) (send|recv) step (\d+) (to|from) rank (\d+) \((\d+) B\)$")


def _spans(path) -> list[dict]:
    """The complete events of a trace file (it must be valid JSON)."""
    return [e for e in json.loads(Path(path).read_text())["traceEvents"] if e.get("ph") == "X"]


def _step_counts(spans) -> collections.Counter:
    """(op, step) -> how many compute spans name that ring step."""
    return collections.Counter((m[1], int(m[2])) for e in spans if (m := STEP.match(e["name"])))


# -- single process ----------------------------------------------------------------------------------------


def test_trace_option_is_validated():
    assert BurstConfig(trace=Path("traces")).trace == "traces"
    assert BurstConfig().trace is None
    for bad in (3, "", b"traces", True):
        with pytest.raises(ValueError, match="option 'trace' must be a directory path or None"):
            BurstConfig(trace=bad)


def test_hidden_time_is_the_part_of_a_transfer_spent_computing(monkeypatch):
    """A recorded call with a fake clock: it starts at -1, posted at 0 (posting takes 0.5 s), step 0 computes 1..4,
    the wait runs 6..7.5; the last hop (step 1) is posted at 8 and waited for at once; the call ends at 10.
    Hidden 3 of 7.5 s, exposed 0.5 + 1.5; the call took 11 s, 3 of them computing."""
    clock = iter([-1.0, 0.0, 0.5, 1.0, 4.0, 6.0, 7.5, 8.0, 8.25, 8.25, 9.0, 10.0])
    monkeypatch.setattr(ring_stats.time, "perf_counter", lambda: next(clock))
    ring = types.SimpleNamespace(size=2, rank=0, peer=lambda offset: offset % 2, extra_backward_hops=1)
    q = torch.zeros(1, 2, 4, 8)
    with ring_stats.record_stats() as stats:
        recorder = ring_stats.CallRecorder("backward", "kv_ring", ring, "zigzag", "causal", q, q)
        with recorder.posting(0, lambda: [("send", 1, 64, 1)]) as posted:
            pass
        with recorder.step(0, 0, 0):
            pass
        posted.waiting()
        posted.request_done(0)
        posted.waited()
        with recorder.posting(1, lambda: [("recv", 1, 64, 1)]) as last_hop:
            pass
        last_hop.waiting()
        last_hop.waited()
        recorder.publish()
    call = stats.calls[0]
    assert call.transfer_s_per_step == [7.5, 1.0, 0.0]  # P + 1 = 3 steps in the backward
    assert call.hidden_s_per_step == [3.0, 0.0, 0.0]
    assert call.exposed_s_per_step == [2.0, 1.0, 0.0]
    assert call.overlap == stats.overlap == pytest.approx(3.0 / 8.5)
    assert (call.wall_s, call.compute_s) == (11.0, 3.0)
    assert ring_stats._overlap_s(0, 10, [(1, 3), (5, 12), (-4, -1)]) == 7


def test_a_step_posted_in_parts_counts_the_union_of_their_intervals(monkeypatch):
    """A prefetched first transfer: part one posted at 0 (the call then away 0.5..3), part two posted at 3; both
    waited for 4..5 after step 0 computes 3.5..4.  Step 0's transfer is 0..5 (5 s, not 5 + 2), hidden 3 of it
    (2.5 away, 0.5 computing); the double-counting version said 7 and 3.5."""
    clock = iter([-1.0, 0.0, 0.0, 0.5, 3.0, 3.0, 3.0, 3.5, 4.0, 4.0, 5.0, 4.5, 5.0, 6.0])
    monkeypatch.setattr(ring_stats.time, "perf_counter", lambda: next(clock))
    ring = types.SimpleNamespace(size=2, rank=0, peer=lambda offset: offset % 2, extra_backward_hops=1)
    q = torch.zeros(1, 2, 4, 8)
    with ring_stats.record_stats() as stats:
        recorder = ring_stats.CallRecorder("backward", "burst", ring, "zigzag", "causal", q, q)
        with recorder.posting(0, lambda: [("send", 1, 64, 1)]) as early:  # posted 0..0
            pass
        come_back = recorder.leave()  # left at 0.5
        come_back()  # back at 3
        with recorder.posting(0, lambda: [("send", 1, 32, 1)]) as rest:  # posted 3..3
            pass
        with recorder.step(0, 0, 0):  # 3.5..4
            pass
        early.waiting()  # 4
        early.waited()  # 5
        rest.waiting()  # 4.5
        rest.waited()  # 5
        recorder.publish()  # 6
    call = stats.calls[0]
    assert call.transfer_s_per_step[0] == 5.0
    assert call.hidden_s_per_step[0] == 3.0
    assert call.exposed_s_per_step[0] == 1.0 + 0.5  # each wait's own time, plus posting (0 here)
    assert ring_stats._uncovered(0, 10, [(2, 3), (1, 2.5), (8, 12)]) == [(0, 1), (3, 8)]
    assert ring_stats._uncovered(0, 10, [(-1, 11)]) == []


def test_nothing_is_recorded_or_traced_when_off(monkeypatch):
    def no_span(name):
        raise AssertionError(f"a span was opened with tracing off: {name}")

    monkeypatch.setattr(ring_stats, "record_function", no_span)
    ring = types.SimpleNamespace(size=2, rank=0, peer=lambda offset: offset % 2, extra_backward_hops=1)
    q = torch.zeros(1, 2, 4, 8)
    recorder = ring_stats.CallRecorder("forward", None, ring, "zigzag", "causal", q, q)
    def describe():
        raise AssertionError("transfers described with nothing recorded")

    assert recorder.step(0, 0, 0) is recorder.posting(0, describe) is ring_stats._NOTHING


class _Tiny(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.linear = torch.nn.Linear(8, 8)

    def forward(self, x):
        return self.linear(x).relu().sum()


def test_trace_option_writes_a_file_per_call_after_the_first(tmp_path, monkeypatch):
    """BURSTC_TRACE: the second and third calls are traced (the first compiles), each from the call to the next
    (or to flush()), its backward included; without the option and the variable, no file and no profiler."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("BURSTC_TRACE", raising=False)
    model = _Tiny()
    plain = burstc.compile(model, backend="aot_eager")
    started = []
    monkeypatch.setattr(torch.profiler.profile, "start", lambda self: started.append(self))
    for _ in range(3):
        plain(torch.randn(2, 8)).backward()
    assert not started and not list(tmp_path.iterdir())
    monkeypatch.undo()

    monkeypatch.setenv("BURSTC_TRACE", str(tmp_path / "traces"))
    torch._dynamo.reset()
    traced = burstc.compile(model, backend="aot_eager")
    for _ in range(3):
        traced(torch.randn(2, 8)).backward()
    assert [p.name for p in (tmp_path / "traces").iterdir()] == ["rank0-call1.json"]  # call 2's is open
    timeline.flush()
    assert sorted(p.name for p in (tmp_path / "traces").iterdir()) == ["rank0-call1.json", "rank0-call2.json"]
    names = {e["name"] for e in _spans(tmp_path / "traces" / "rank0-call2.json")}
    assert any("Backward" in n for n in names), sorted(names)  # the window covers the backward
    assert [w.call for w in burstc.report(traced).traces] == [1, 2]


def test_trace_block_of_a_model_is_listed_in_its_report(tmp_path):
    model = _Tiny()
    with pytest.raises(TypeError, match="burstc.compile"):
        with burstc.trace(tmp_path, model=model):
            pass
    cmodel = burstc.compile(model, backend="aot_eager")
    with burstc.trace(tmp_path, model=cmodel) as window:
        cmodel(torch.randn(2, 8)).backward()
    assert burstc.report(cmodel).traces == [window] and window.path == tmp_path / "rank0.json"
    assert f"trace of rank 0: no ring transfers -> {window.path}" in str(burstc.report(cmodel))


def test_trace_block_with_no_ring_call(tmp_path):
    with burstc.trace(tmp_path) as window:
        torch.randn(4, 4).sum()
    assert window.overlap is None and window.stats.calls == []
    assert any(e["name"].startswith("aten::") for e in _spans(tmp_path / "rank0.json"))
    names = [e for e in json.loads((tmp_path / "rank0.json").read_text())["traceEvents"]
             if e.get("name") == "process_name" and e["pid"] == os.getpid()]
    assert [e["args"]["name"] for e in names] == ["rank 0"]
    with burstc.trace(tmp_path):
        with pytest.raises(RuntimeError, match="already being written"):
            with burstc.trace(tmp_path / "inner"):
                pass


# -- several ranks -----------------------------------------------------------------------------------------


def eager_trace_task(rank, world_size, directory, plan):
    """ring_attention forward and backward (full mask: every pair exchanges) inside burstc.trace."""
    torch.manual_seed(0)
    q = torch.randn(1, 4, 16, 8, requires_grad=True)
    k, v = (torch.randn(1, 2, 16, 8, requires_grad=True) for _ in range(2))
    with burstc.trace(directory) as window:
        burstc.ring_attention(q, k, v, causal=False, plan=plan).sum().backward()
    return [(c.overlap, c.wall_s, c.compute_s) for c in window.stats.calls], window.overlap


@pytest.mark.parametrize("world_size, plan", [(2, "kv_ring"), (4, "burst")])
def test_trace_names_every_ring_step_and_transfer_peer(workers, tmp_path, world_size, plan):
    results = workers.get(world_size).run(eager_trace_task, str(tmp_path), plan)
    assert sorted(os.listdir(tmp_path)) == sorted(f"rank{r}.json" for r in range(world_size))
    for rank, (call_overlaps, overlap) in enumerate(results):
        spans = _spans(tmp_path / f"rank{rank}.json")
        steps = _step_counts(spans)
        assert steps == {(op, t): 1 for op in ("fwd", "bwd") for t in range(world_size)}
        pairs = {(m[1], int(m[2])): (int(m[3]), int(m[4])) for e in spans if (m := STEP.match(e["name"]))}
        # step t attends the queries held here to rank - t's keys (kv_ring), or rank - t's queries to the keys
        # held here (burst's backward)
        for t in range(world_size):
            assert pairs["fwd", t] == (rank, (rank - t) % world_size)
            visitor = (rank - t) % world_size
            assert pairs["bwd", t] == ((visitor, rank) if plan == "burst" else (rank, visitor))
        transfers = [(m, e) for e in spans if (m := TRANSFER.match(e["name"]))]
        for m, event in transfers:
            args = event["args"]
            assert (args["direction"], args["peer"], args["bytes"]) == (m[2], int(m[5]), int(m[6]))
            assert args["peer"] != rank and args["bytes"] > 0 and event["dur"] >= 0
            assert event["tid"] != next(e["tid"] for e in spans if STEP.match(e["name"]))  # a track of its own
        forward = {(m[2], int(m[3]), int(m[5])) for m, _ in transfers if m[1] == "fwd"}
        # the forward's step t posts step t + 1's blocks: to rank + t + 1, from rank - t - 1
        assert forward == {(d, t, (rank + sign * (t + 1)) % world_size)
                           for t in range(world_size - 1) for d, sign in (("send", 1), ("recv", -1))}
        # the backward's step t posts step t + 1's inputs (t < P - 1) and returns step t - 1's gradients (t >= 2;
        # step P: the last hop)
        hops = {int(m[3]) for m, _ in transfers if m[1] == "bwd"}
        assert hops == set(range(world_size - 1)) | set(range(2, world_size + 1))
        assert len(call_overlaps) == 2 and all(0 <= x <= 1 for x, _, _ in call_overlaps)
        assert all(0 < compute_s <= wall_s for _, wall_s, compute_s in call_overlaps)  # each call's time, its compute
        assert 0 <= overlap <= 1


def double_ring_trace_task(rank, world_size, directory, plan):
    """The double ring on a 2 x 2 mesh inside burstc.trace (a trace once crashed there: its ring had no global
    peer of its own to name the blocks' owners by)."""
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("inter", "intra"))
    torch.manual_seed(0)
    q = torch.randn(1, 4, 16, 8, requires_grad=True)
    k, v = (torch.randn(1, 2, 16, 8, requires_grad=True) for _ in range(2))
    with burstc.trace(directory):
        burstc.ring_attention(q, k, v, causal=False, plan=plan, group_or_mesh=mesh, ring="double").sum().backward()


@pytest.mark.parametrize("plan", ["kv_ring", "burst"])
def test_trace_names_every_double_ring_step(workers, tmp_path, plan):
    workers.get(4).run(double_ring_trace_task, str(tmp_path), plan)
    for rank in range(4):
        spans = _spans(tmp_path / f"rank{rank}.json")
        assert _step_counts(spans) == {(op, t): 1 for op in ("fwd", "bwd") for t in range(4)}
        pairs = {(m[1], int(m[2])): (int(m[3]), int(m[4])) for e in spans if (m := STEP.match(e["name"]))}
        # named by sequence ranks: the forward attends this rank's queries to every rank's keys once; the
        # backward pairs this rank with every rank once, on the side the plan keeps here
        assert sorted(pairs["fwd", t][1] for t in range(4)) == [0, 1, 2, 3]
        assert all(pairs["fwd", t][0] == rank for t in range(4))
        stays, visits = (1, 0) if plan == "burst" else (0, 1)
        assert all(pairs["bwd", t][stays] == rank for t in range(4))
        assert sorted(pairs["bwd", t][visits] for t in range(4)) == [0, 1, 2, 3]
        assert any(TRANSFER.match(e["name"]) for e in spans)


def compiled_trace_task(rank, world_size, directory, layers):
    """Two training steps of a tiny Llama compiled with trace=directory: the second is traced."""
    from torch.distributed.device_mesh import init_device_mesh

    from burstc.testing.zoo.titan import TitanLlama, TitanLlamaArgs, WithLoss

    torch._dynamo.reset()
    torch.manual_seed(0)
    model = WithLoss(TitanLlama(TitanLlamaArgs(dim=32, n_layers=layers, n_heads=4, n_kv_heads=2, vocab_size=64,
                                               max_seq_len=64)))
    cmodel = burstc.compile(model, init_device_mesh("cpu", (world_size,)), backend="aot_eager", trace=directory)
    ids = torch.randint(0, 64, (1, 33), generator=torch.Generator().manual_seed(1))
    for _ in range(2):
        cmodel(ids[:, :-1], ids[:, 1:]).backward()
    timeline.flush()
    report = burstc.report(cmodel)
    window = report.traces[0]
    return len(report.traces), str(report), window.overlap, [c.op for c in window.stats.calls]


def test_compiled_training_step_is_traced_on_every_rank(workers, tmp_path):
    world_size, layers = 2, 2
    results = workers.get(world_size).run(compiled_trace_task, str(tmp_path), layers)
    assert sorted(os.listdir(tmp_path)) == [f"rank{r}-call1.json" for r in range(world_size)]
    for rank, (windows, report, overlap, ops) in enumerate(results):
        assert windows == 1 and ops == ["forward"] * layers + ["backward"] * layers
        assert 0 <= overlap <= 1
        assert f"trace of call 1, rank {rank}: {2 * layers} ring call(s)" in report
        assert f"overlap {overlap:.2f} -> {tmp_path / f'rank{rank}-call1.json'}" in report
        spans = _spans(tmp_path / f"rank{rank}-call1.json")
        assert _step_counts(spans) == {(op, t): layers for op in ("fwd", "bwd") for t in range(world_size)}
        peers = {e["args"]["peer"] for e in spans if TRANSFER.match(e["name"])}
        assert peers == {1 - rank}
