"""A persistent group of gloo worker processes for multi-rank tests and benchmarks.

Starting P processes and a gloo process group costs seconds, so tests start one group per world
size and send it many small tasks (hypothesis examples included)::

    from burstc.testing import WorkerGroup

    def my_task(rank, world_size, seed):          # module level, so that it pickles
        ...                                       # the default process group is initialized
        return some_picklable_result

    with WorkerGroup(4) as group:
        per_rank_results = group.run(my_task, 123, timeout=60)

Fixture pattern (one group per world size per test module, reused by every test and every
hypothesis example of that module; hypothesis accepts module-scoped fixtures)::

    @pytest.fixture(scope="module")      # tests/conftest.py defines this one ``workers`` fixture
    def workers():
        with WorkerPool() as pool:       # pool.get(P) starts the P-rank group on first use
            yield pool

    @given(world_size=st.sampled_from([1, 2, 4]), seed=st.integers(0, 2**31 - 1))
    def test_something(workers, world_size, seed):
        results = workers.get(world_size).run(my_task, seed)

Each task receives its inputs (for example a seed) as arguments and must build everything
deterministically from them, so that all ranks agree.  Outside pytest, :func:`get_worker_group`
keeps one group per world size for the whole process and shuts them down at exit.

Failure handling: an exception in any rank is re-raised in the parent as :class:`WorkerError`
naming the rank, with the remote traceback.  Every :meth:`WorkerGroup.run` has a timeout; when a
worker hangs or dies the parent raises within that timeout and tears the whole group down (a
later :meth:`WorkerPool.get` / :func:`get_worker_group` starts a fresh one).
"""
from __future__ import annotations

import atexit
import itertools
import os
import queue
import time
import traceback
from datetime import timedelta
from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

DEFAULT_RUN_TIMEOUT_S = 120.0
DEFAULT_START_TIMEOUT_S = 120.0
# How long to keep collecting the other ranks' answers after one rank failed: ranks blocked in a
# collective with the failed rank never answer, and then the group must be torn down.
_FAILURE_GRACE_S = 5.0
_POLL_S = 0.1

# Set in every worker before torch spawns any thread pool: P workers share few cores.
_WORKER_ENV = {
    "OMP_NUM_THREADS": "1",
    "MKL_NUM_THREADS": "1",
    "TORCHINDUCTOR_COMPILE_THREADS": "1",
}


class WorkerError(RuntimeError):
    """A task raised in a worker. ``rank``, ``remote_type`` (exception class name) and
    ``remote_traceback`` describe the first failing rank."""

    def __init__(self, rank: int, remote_type: str, message: str, remote_traceback: str):
        self.rank = rank
        self.remote_type = remote_type
        self.remote_message = message
        self.remote_traceback = remote_traceback
        super().__init__(
            f"rank {rank} raised {remote_type}: {message}\n"
            f"--- remote traceback (rank {rank}) ---\n{remote_traceback}"
        )


class WorkerGroupDead(RuntimeError):
    """The group was torn down (a worker died, hung, or the group was shut down)."""


def _worker_main(
    rank: int,
    world_size: int,
    store_host: str,
    store_port: int,
    collective_timeout_s: float,
    task_queue,
    result_queue,
) -> None:
    os.environ.update(_WORKER_ENV)
    torch.set_num_threads(1)
    try:
        store = dist.TCPStore(
            store_host, store_port, world_size, is_master=False,
            timeout=timedelta(seconds=collective_timeout_s),
        )
        dist.init_process_group(
            "gloo", store=store, rank=rank, world_size=world_size,
            timeout=timedelta(seconds=collective_timeout_s),
        )
    except BaseException as exc:  # reported to the parent, which raises
        result_queue.put(("start", rank, False, (type(exc).__name__, str(exc), traceback.format_exc())))
        return
    result_queue.put(("start", rank, True, None))
    parent = os.getppid()
    while True:
        try:
            message = task_queue.get(timeout=_POLL_S * 10)
        except queue.Empty:
            if os.getppid() != parent:  # the parent died without shutting us down
                break
            continue
        if message is None:
            break
        task_id, fn, args, kwargs = message
        try:
            result = fn(rank, world_size, *args, **kwargs)
        except BaseException as exc:
            result_queue.put((task_id, rank, False, (type(exc).__name__, str(exc), traceback.format_exc())))
        else:
            result_queue.put((task_id, rank, True, result))
    dist.destroy_process_group()
    # Every answer was collected by the parent before it sent the stop message, so nothing is left to flush:
    # skip the interpreter's teardown (atexit handlers, freeing every compiled graph), seconds per rank.
    result_queue.close()
    result_queue.join_thread()
    os._exit(0)


class WorkerGroup:
    """``world_size`` spawned processes, each a rank of one gloo default process group.

    ``run(fn, *args, timeout=None, **kwargs)`` calls ``fn(rank, world_size, *args, **kwargs)`` in
    every worker and returns the results as a list indexed by rank.  ``fn``, its arguments and its
    results must pickle (``fn`` at module level).
    """

    def __init__(
        self,
        world_size: int,
        *,
        run_timeout_s: float = DEFAULT_RUN_TIMEOUT_S,
        start_timeout_s: float = DEFAULT_START_TIMEOUT_S,
        collective_timeout_s: float | None = None,
    ):
        if world_size < 1:
            raise ValueError(f"world_size must be >= 1, got {world_size}")
        self.world_size = world_size
        self.run_timeout_s = run_timeout_s
        self._task_ids = itertools.count()
        self._processes: list = []
        self._alive = False
        context = mp.get_context("spawn")
        self._result_queue = context.Queue()
        self._task_queues = [context.Queue() for _ in range(world_size)]
        # The parent hosts the rendezvous store on a free port chosen by the OS (port=0), so that
        # concurrent groups and test sessions never race for a port.
        self._store = dist.TCPStore("127.0.0.1", 0, world_size, is_master=True, wait_for_workers=False)
        collective_timeout_s = collective_timeout_s or max(run_timeout_s, start_timeout_s)
        for rank in range(world_size):
            process = context.Process(
                target=_worker_main,
                args=(rank, world_size, "127.0.0.1", self._store.port, collective_timeout_s,
                      self._task_queues[rank], self._result_queue),
                daemon=True,
                name=f"burstc-worker-{world_size}-{rank}",
            )
            process.start()
            self._processes.append(process)
        self._alive = True
        try:
            self._collect("start", start_timeout_s)
        except BaseException:
            self.shutdown()
            raise

    @property
    def alive(self) -> bool:
        return self._alive and all(p.is_alive() for p in self._processes)

    def run(self, fn: Callable[..., Any], *args, timeout: float | None = None, **kwargs) -> list:
        if not self.alive:
            self.shutdown()
            raise WorkerGroupDead(f"the {self.world_size}-rank worker group is not running")
        task_id = next(self._task_ids)
        for task_queue in self._task_queues:
            task_queue.put((task_id, fn, args, kwargs))
        return self._collect(task_id, self.run_timeout_s if timeout is None else timeout)

    def _collect(self, task_id, timeout: float) -> list:
        results: dict[int, Any] = {}
        failures: dict[int, tuple[str, str, str]] = {}
        deadline = time.monotonic() + timeout
        while len(results) + len(failures) < self.world_size:
            now = time.monotonic()
            if now > deadline:
                break
            try:
                got_id, rank, ok, payload = self._result_queue.get(timeout=min(_POLL_S, deadline - now))
            except queue.Empty:
                dead = [r for r, p in enumerate(self._processes)
                        if not p.is_alive() and r not in results and r not in failures]
                if dead:
                    codes = {r: self._processes[r].exitcode for r in dead}
                    self.shutdown()
                    raise WorkerGroupDead(
                        f"worker rank(s) {dead} of the {self.world_size}-rank group died "
                        f"(exit codes {codes}) during task {task_id!r}; group torn down"
                    )
                continue
            if got_id != task_id:  # a late answer to an earlier, timed-out task: cannot happen
                continue           # after teardown, but never mix results up
            if ok:
                results[rank] = payload
            else:
                failures[rank] = payload
                deadline = min(deadline, time.monotonic() + _FAILURE_GRACE_S)
        if failures:
            if len(results) + len(failures) < self.world_size:
                self.shutdown()  # the silent ranks are stuck (e.g. in a collective): unusable
            rank = min(failures)
            raise WorkerError(rank, *failures[rank])
        if len(results) < self.world_size:
            missing = sorted(set(range(self.world_size)) - set(results))
            self.shutdown()
            raise TimeoutError(
                f"rank(s) {missing} of the {self.world_size}-rank group did not finish task "
                f"{task_id!r} within {timeout:.1f} s; group torn down"
            )
        return [results[r] for r in range(self.world_size)]

    def shutdown(self, join_timeout_s: float = 5.0) -> None:
        """Stop the workers (politely, then by force).  Idempotent."""
        if not self._processes:
            return
        was_alive, self._alive = self._alive, False
        if was_alive:
            for task_queue in self._task_queues:
                try:
                    task_queue.put(None)
                except (OSError, ValueError):
                    pass
        deadline = time.monotonic() + join_timeout_s
        for process in self._processes:
            process.join(timeout=max(0.0, deadline - time.monotonic()))
        for process in self._processes:
            if process.is_alive():
                process.kill()
                process.join(timeout=join_timeout_s)
        self._processes = []
        for q in (*self._task_queues, self._result_queue):
            q.cancel_join_thread()
            q.close()

    def __enter__(self) -> "WorkerGroup":
        return self

    def __exit__(self, *exc_info) -> None:
        self.shutdown()

    def __del__(self):
        try:
            self.shutdown(join_timeout_s=1.0)
        except Exception:
            pass


def _all_reduce_ranks(rank: int, world_size: int) -> tuple[int, float]:
    """(sum of rank + 1 over the group, this worker's resident memory in MiB)."""
    total = torch.tensor([rank + 1], dtype=torch.int64)
    dist.all_reduce(total)
    with open("/proc/self/status") as status:
        rss_kib = next((int(line.split()[1]) for line in status if line.startswith("VmRSS:")), 0)
    return int(total), rss_kib / 1024


class WorkerPool:
    """Lazily started :class:`WorkerGroup` per world size; ``get`` restarts a group torn down by
    an earlier failure.  ``max_ranks``: starting a group stops the least recently used others until at most
    that many worker processes are alive (idle workers hold their imports and caches: ~0.5 GB each)."""

    def __init__(self, *, max_ranks: int | None = None, **group_kwargs):
        self._group_kwargs = group_kwargs
        self._max_ranks = max_ranks
        self._groups: dict[int, WorkerGroup] = {}  # least recently used first

    def get(self, world_size: int) -> WorkerGroup:
        group = self._groups.pop(world_size, None)
        if group is None or not group.alive:
            if group is not None:
                group.shutdown()
            if self._max_ranks is not None:
                while self._groups and sum(self._groups) + world_size > self._max_ranks:
                    self._groups.pop(next(iter(self._groups))).shutdown()
            group = WorkerGroup(world_size, **self._group_kwargs)
        self._groups[world_size] = group
        return group

    def check_health(self, timeout_s: float = 30.0, max_rss_mib: float | None = None) -> list[int]:
        """Stop every group that no longer answers one collective in step (a task that stalled a rank or left a
        collective half-done) or, with ``max_rss_mib``, one whose largest worker holds more memory than that (a
        worker grows with every compile it ran, and a grown one compiles slower); returns the world sizes
        stopped.  Run between users of a shared pool."""
        stopped = []
        for world_size, group in list(self._groups.items()):
            try:
                answers = group.run(_all_reduce_ranks, timeout=timeout_s) if group.alive else None
                healthy = answers is not None and [total for total, _ in answers] == (
                    [world_size * (world_size + 1) // 2] * world_size)
                if healthy and max_rss_mib is not None:
                    healthy = max(rss for _, rss in answers) <= max_rss_mib
            except Exception:
                healthy = False
            if not healthy:
                self._groups.pop(world_size).shutdown()
                stopped.append(world_size)
        return stopped

    def shutdown(self) -> None:
        for group in self._groups.values():
            group.shutdown()
        self._groups.clear()

    def __enter__(self) -> "WorkerPool":
        return self

    def __exit__(self, *exc_info) -> None:
        self.shutdown()


_SESSION_POOL = WorkerPool()
atexit.register(_SESSION_POOL.shutdown)


def get_worker_group(world_size: int) -> WorkerGroup:
    """The process-wide group for ``world_size`` ranks, started on first use and shut down at
    interpreter exit (or torn down and restarted after a failure)."""
    return _SESSION_POOL.get(world_size)


def shutdown_worker_groups() -> None:
    """Stop every group started by :func:`get_worker_group`."""
    _SESSION_POOL.shutdown()
