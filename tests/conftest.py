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


@pytest.fixture(scope="module")
def workers(request):
    """One :class:`WorkerPool` per test module (``pool.get(P)`` starts the P-rank group on first use), reused
    by every test and hypothesis example of the module.  A module sets ``WORKER_RUN_TIMEOUT_S`` to change
    its groups' per-task timeout."""
    run_timeout_s = getattr(request.module, "WORKER_RUN_TIMEOUT_S", DEFAULT_RUN_TIMEOUT_S)
    with WorkerPool(run_timeout_s=run_timeout_s) as pool:
        yield pool


def pytest_collection_modifyitems(config, items):
    for item in items:
        if "workers" in item.fixturenames:
            item.add_marker(pytest.mark.multirank)
