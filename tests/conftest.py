"""Shared fixtures: a fresh Dynamo per test, and the one ``workers`` fixture (gloo worker groups).

Every test that takes ``workers`` is marked ``multirank``, so ``pytest -m "not multirank"`` is the fast,
single-process tier."""
import pytest
import torch

from burstc.testing import WorkerPool
from burstc.testing.workers import DEFAULT_RUN_TIMEOUT_S


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    """Each test compiles from scratch: no Dynamo cache entries leak between tests."""
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


# the longest per-task timeout a module asks for (WORKER_RUN_TIMEOUT_S): the groups' collective timeout
_LONGEST_RUN_TIMEOUT_S = 300.0
# a worker grown past this (~2x a fresh one after its first HF compile) is replaced after the module: every
# compile leaves some memory behind, and in a grown worker each gc.collect() (and the gc passes inside a
# compile) walks it all (a test collecting between calls ran 2-3x slower in workers that had served a few modules)
_MAX_WORKER_RSS_MIB = 1024


@pytest.fixture(scope="session")
def _worker_pool():
    """The session's gloo worker groups: a P-rank group starts once (~6 s for 2 ranks, ~12 s for 4 on two cores:
    spawning, imports, Dynamo's first compile) and serves every module; at most 10 worker processes idle (groups
    of 1 to 4 ranks at once: hypothesis tests draw the world size)."""
    with WorkerPool(max_ranks=10, collective_timeout_s=_LONGEST_RUN_TIMEOUT_S) as pool:
        yield pool


class _ModuleWorkers:
    """The session's pool as one module sees it: its groups run with the module's per-task timeout."""

    def __init__(self, pool: WorkerPool, run_timeout_s: float):
        self._pool, self._run_timeout_s = pool, run_timeout_s

    def get(self, world_size: int):
        group = self._pool.get(world_size)
        group.run_timeout_s = self._run_timeout_s
        return group


@pytest.fixture(scope="module")
def workers(request, _worker_pool):
    """The worker groups (``workers.get(P)`` starts the P-rank group on first use), shared by every module and
    hypothesis example; a module sets ``WORKER_RUN_TIMEOUT_S`` to change its per-task timeout.  After each
    module, a group that no longer runs one collective in step is stopped (the next ``get`` starts a fresh
    one): a module that stalls or kills ranks leaves nothing behind."""
    run_timeout_s = getattr(request.module, "WORKER_RUN_TIMEOUT_S", DEFAULT_RUN_TIMEOUT_S)
    assert run_timeout_s <= _LONGEST_RUN_TIMEOUT_S, "raise _LONGEST_RUN_TIMEOUT_S (the collective timeout) too"
    yield _ModuleWorkers(_worker_pool, run_timeout_s)
    _worker_pool.check_health(max_rss_mib=_MAX_WORKER_RSS_MIB)


def pytest_collection_modifyitems(config, items):
    for item in items:
        if "workers" in item.fixturenames:
            item.add_marker(pytest.mark.multirank)
