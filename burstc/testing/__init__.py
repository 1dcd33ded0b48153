"""burstc's test kit, shared by tests, examples and benchmarks.

- :mod:`burstc.testing.workers`: persistent gloo worker groups (``WorkerGroup``, ``WorkerPool``,
  ``get_worker_group``) for multi-rank tests and benchmarks;
- :mod:`burstc.testing.oracle`: the equivalence oracle (``assert_equivalent`` on P ranks,
  ``assert_same_training_step`` on one device) and the one tolerance table (``TOLERANCES``, ``tolerance``);
- :mod:`burstc.testing.zoo`: the model zoo (torchtitan-style Llama, nanoGPT, tiny HF configs, hand-written
  probes), imported on use (``from burstc.testing import zoo``).
"""
from burstc.testing.oracle import (
    TOLERANCES,
    Tolerance,
    assert_equivalent,
    assert_same_training_step,
    tolerance,
)
from burstc.testing.workers import (
    WorkerError,
    WorkerGroup,
    WorkerGroupDead,
    WorkerPool,
    get_worker_group,
    shutdown_worker_groups,
)

__all__ = [
    "TOLERANCES", "Tolerance", "WorkerError", "WorkerGroup", "WorkerGroupDead", "WorkerPool",
    "assert_equivalent", "assert_same_training_step", "get_worker_group", "shutdown_worker_groups", "tolerance",
]
