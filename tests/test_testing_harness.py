"""The gloo worker-group harness: per-rank results, error propagation, timeouts without hangs."""
from __future__ import annotations

import os
import time

import pytest
import torch
import torch.distributed as dist

from burstc.testing import WorkerError, WorkerGroup, WorkerGroupDead, WorkerPool, get_worker_group

pytestmark = pytest.mark.multirank


def _rank_info(rank, world_size, offset):
    summed = torch.tensor([float(rank)])
    dist.all_reduce(summed)
    return {"rank": rank, "world_size": world_size, "dist_rank": dist.get_rank(), "offset": offset,
            "sum_of_ranks": summed.item(), "threads": torch.get_num_threads(), "pid": os.getpid(),
            "omp": os.environ.get("OMP_NUM_THREADS")}


def _kwargs_echo(rank, world_size, *, value):
    return value * (rank + 1)


def _raise_on_rank(rank, world_size, bad_rank):
    if rank == bad_rank:
        raise ValueError(f"deliberate failure on rank {rank}")
    return rank


def _raise_then_hang_peers(rank, world_size):
    # rank 1 fails, the others block in a collective that can never complete
    if rank == 1:
        raise KeyError("rank one is broken")
    dist.barrier()
    return rank


def _sleep(rank, world_size, seconds):
    time.sleep(seconds)
    return rank


def _die_on_rank(rank, world_size, bad_rank):
    if rank == bad_rank:
        os._exit(3)
    time.sleep(30)
    return rank


def _mesh_all_gather(rank, world_size):
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (world_size,))
    gathered = [torch.zeros(1) for _ in range(world_size)]
    dist.all_gather(gathered, torch.tensor([rank * 10.0]), group=mesh.get_group())
    return [t.item() for t in gathered]


# the conftest's `workers` fixture gives this module's worker groups this run timeout
WORKER_RUN_TIMEOUT_S = 60


@pytest.mark.parametrize("world_size", [1, 3])
def test_results_are_per_rank_and_group_is_initialized(workers, world_size):
    results = workers.get(world_size).run(_rank_info, 7)
    assert [r["rank"] for r in results] == list(range(world_size))
    assert all(r["dist_rank"] == r["rank"] and r["world_size"] == world_size for r in results)
    assert all(r["sum_of_ranks"] == sum(range(world_size)) for r in results)
    assert all(r["offset"] == 7 and r["threads"] == 1 and r["omp"] == "1" for r in results)
    assert len({r["pid"] for r in results}) == world_size


def test_group_is_reused_across_tasks(workers):
    group = workers.get(2)
    first = [r["pid"] for r in group.run(_rank_info, 0)]
    assert group.run(_kwargs_echo, value=5) == [5, 10]
    assert workers.get(2) is group
    assert [r["pid"] for r in group.run(_rank_info, 1)] == first


def test_mesh_collective(workers):
    assert workers.get(2).run(_mesh_all_gather) == [[0.0, 10.0], [0.0, 10.0]]


def test_exception_names_rank_and_keeps_group_when_all_ranks_answered(workers):
    group = workers.get(3)
    with pytest.raises(WorkerError, match=r"rank 2 raised ValueError: deliberate failure on rank 2") as info:
        group.run(_raise_on_rank, 2)
    assert info.value.rank == 2 and info.value.remote_type == "ValueError"
    assert "_raise_on_rank" in info.value.remote_traceback  # the remote traceback is included
    assert group.alive and group.run(_kwargs_echo, value=1) == [1, 2, 3]  # still usable


def test_exception_with_hung_peers_tears_group_down(workers):
    group = workers.get(3)
    start = time.monotonic()
    with pytest.raises(WorkerError, match="rank 1 raised KeyError"):
        group.run(_raise_then_hang_peers, timeout=30)
    assert time.monotonic() - start < 20  # grace period, not the full timeout
    assert not group.alive
    with pytest.raises(WorkerGroupDead):
        group.run(_kwargs_echo, value=1)
    assert workers.get(3).run(_kwargs_echo, value=2) == [2, 4, 6]  # the pool starts a fresh group


def test_timeout_raises_within_timeout_and_tears_down():
    with WorkerGroup(2, run_timeout_s=30) as group:
        start = time.monotonic()
        with pytest.raises(TimeoutError, match=r"rank\(s\) \[0, 1\].*within 1.0 s"):
            group.run(_sleep, 60, timeout=1.0)
        # well before the 60 s sleep ends (a loaded 2-core machine took 10.9 s to raise and tear down)
        assert time.monotonic() - start < 30
        assert not group.alive


def test_dead_worker_is_detected():
    with WorkerGroup(2, run_timeout_s=60) as group:
        start = time.monotonic()
        with pytest.raises(WorkerGroupDead, match=r"rank\(s\) \[1\].*died.*exit codes \{1: 3\}"):
            group.run(_die_on_rank, 1)
        assert time.monotonic() - start < 20
        assert not group.alive


def test_session_cache_returns_same_group():
    group = get_worker_group(1)
    assert get_worker_group(1) is group
    assert group.run(_kwargs_echo, value=3) == [3]


def _leave_a_collective_pending(rank, world_size):
    # rank 1 starts an all-reduce it never waits for and rank 0 never joins: the group is out of step
    if rank == 1:
        dist.all_reduce(torch.ones(1), async_op=True)
    return rank


def test_pool_stops_the_least_recently_used_groups_beyond_max_ranks():
    with WorkerPool(max_ranks=4, run_timeout_s=60) as pool:
        one, two = pool.get(1), pool.get(2)
        assert pool.get(1) is one  # now the most recently used
        three = pool.get(3)  # 1 + 2 + 3 ranks > 4: the two-rank group stops, the one-rank group stays
        assert one.alive and three.alive and not two.alive
        assert three.run(_kwargs_echo, value=1) == [1, 2, 3] and one.run(_kwargs_echo, value=2) == [2]


def test_health_check_stops_only_the_groups_out_of_step():
    with WorkerPool(run_timeout_s=60) as pool:
        healthy, broken = pool.get(1), pool.get(2)
        assert pool.check_health(timeout_s=5.0) == []
        broken.run(_leave_a_collective_pending)
        assert pool.check_health(timeout_s=5.0) == [2]
        assert healthy.alive and not broken.alive
        assert pool.get(2) is not broken and pool.get(2).run(_kwargs_echo, value=1) == [1, 2]
        # and groups whose workers grew past a memory limit (every worker holds more than 1 MiB)
        assert sorted(pool.check_health(timeout_s=5.0, max_rss_mib=1.0)) == [1, 2] and not healthy.alive
