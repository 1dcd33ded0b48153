"""burstc's test kit, shared by tests, examples and benchmarks.

- :mod:`burstc.testing.workers`: persistent gloo worker groups (``WorkerGroup``, ``WorkerPool``,
  ``get_worker_group``) for multi-rank tests and benchmarks;
- :mod:`burstc.testing.zoo`: the model zoo (torchtitan-style Llama, nanoGPT, tiny HF configs, hand-written
  probes), imported on use (``from burstc.testing import zoo``).
"""
from burstc.testing.workers import (
    WorkerError,
    WorkerGroup,
    WorkerGroupDead,
    WorkerPool,
    get_worker_group,
    shutdown_worker_groups,
)
from burstc._equivalence import assert_equivalent  # noqa: E402  (needs get_worker_group above)

__all__ = [
    "WorkerError", "WorkerGroup", "WorkerGroupDead", "WorkerPool", "assert_equivalent", "get_worker_group",
    "shutdown_worker_groups",
]
