"""burstc.compile options: one keyword-only, validated dataclass."""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field, fields
from datetime import timedelta

from burstc.layout import LAYOUTS

BACKENDS = ("inductor", "aot_eager")
ATTENTION_PLANS = ("auto", "kv_ring", "burst")
CHECKPOINT_MODES = ("none", "layers", "selective")


@dataclass(frozen=True, kw_only=True)
class BurstConfig:
    backend: str = "inductor"
    """Compiler that lowers the rewritten graphs: ``"inductor"`` or ``"aot_eager"`` (fast, for tests)."""

    disable_passes: tuple[str, ...] = ()
    """Names of burstc passes to skip (see ``burstc.passes.PASS_ORDER``)."""

    keep_logits: bool | None = None
    """When the graph returns the logits only as an output (HF models do), ``False`` has the fused LM-head
    loss return a stand-in in their place (they are never materialized; any use of the stand-in raises an
    error that explains this option) and ``True`` keeps them.  ``None``
    (default) drops them from graphs compiled with gradients enabled (training) and keeps them in graphs
    compiled under ``torch.no_grad()`` / ``torch.inference_mode()`` (evaluation, where the logits are
    usually wanted), as Liger-Kernel drops them only in training."""

    lm_head_chunk_size: int | None = None
    """Tokens per chunk of the fused LM-head loss; ``None`` sizes it from the vocab."""

    layout: str = "zigzag"
    """Sequence layout over the mesh: ``contiguous``, ``zigzag`` or ``striped``."""

    attention_plan: str = "auto"
    """Ring-attention backward plan: ``auto`` (planner's cheaper one), ``kv_ring`` or ``burst``."""

    reduce_grads: bool = True
    """Sum parameter gradients over the sequence mesh inside the compiled backward."""

    check_inputs: bool = True
    """On a mesh, every call of a sharded graph checks that all ranks got the same batch (two all-reduces of
    a 2-float hash of the integer inputs): a rank fed its own batch (a ``DistributedSampler`` habit) gets a
    clear error instead of a silently wrong loss.  ``False`` skips the check."""

    sync_module_states: bool = True
    """On a mesh, ``burstc.compile`` broadcasts the module's parameters and buffers from the mesh's first
    rank, as DDP does at construction (and FSDP with ``sync_module_states=True``): ranks that initialized
    the model with different random seeds would otherwise compute one sharded forward from mixed weights."""

    replay_checkpoint_side_effects: bool = False
    """A Python side effect inside a checkpointed region (HF's kernelized layers set a global in every
    forward) makes torch.compile break the graph there, because eager checkpointing replays it during the
    recomputation.  ``False`` (default) lets Dynamo trace through and apply such side effects once, in the
    forward: tensor values are those of the model without checkpointing.  ``True`` keeps torch.compile's
    default (a graph break per checkpointed layer, so no sharding across them)."""

    checkpoint: str = "none"
    """Activation checkpointing burstc adds on a mesh (``passes/checkpoint_layers.py``): ``"none"``,
    ``"layers"`` (each decoder layer recomputed in the backward, ring attention included) or ``"selective"``
    (layers recomputed, each ring attention's output and LSE kept: the recomputation never runs the ring)."""

    memory_budget: int | None = None
    """Bytes per rank that one training step may peak at (parameters, buffers, gradients, activations): on a
    mesh burstc then picks the checkpoint mode itself, the one with the least recomputation whose predicted
    peak fits (``"none"``, then ``"selective"``, then ``"layers"``; the prediction is
    :mod:`burstc.memory`'s, from each mode's own forward and backward graphs), and says which in the report
    (``report.memory_plans``).  When no mode fits, the one predicted to use the least memory runs and the
    report and a warning say so.  It chooses ``checkpoint``, so giving both is an error."""

    fullgraph: bool = False
    """Passed to torch.compile."""

    dynamic: bool | None = False
    """Passed to torch.compile (default static shapes: the passes plan for concrete lengths).  On a mesh, a
    graph whose sequence length is symbolic (``True``, or ``None`` after a second length) is not sharded: the
    shard pass refuses it (code ``shard.dynamic_length``) and it runs replicated, correct but unsharded."""

    timeout: float | None = None
    """On a mesh, seconds (or a ``datetime.timedelta``) that any wait for another rank inside burstc's ops (the
    ring attention's transfers, the ``check_inputs`` check) may take before raising
    :class:`burstc.errors.PeerTimeout` naming the rank waited for.  ``None``: the process group's timeout
    (``dist.init_process_group(timeout=)``, 30 minutes by default).  Per process group: the last
    ``burstc.compile`` on a mesh sets it for every model compiled on that mesh.  With NCCL a bounded wait
    blocks the CPU until the transfer is done (the default wait only orders the CUDA streams), so set it to
    debug a stall rather than in production runs."""

    def __post_init__(self):
        from burstc.passes import PASS_ORDER

        _check_choice("backend", self.backend, BACKENDS)
        _check_choice("layout", self.layout, LAYOUTS)
        _check_choice("attention_plan", self.attention_plan, ATTENTION_PLANS)
        _check_choice("checkpoint", self.checkpoint, CHECKPOINT_MODES)
        if isinstance(self.disable_passes, str):
            object.__setattr__(self, "disable_passes", (self.disable_passes,))
        object.__setattr__(self, "disable_passes", tuple(self.disable_passes))
        unknown = [p for p in self.disable_passes if p not in PASS_ORDER]
        if unknown:
            raise ValueError(f"disable_passes: unknown pass name(s) {unknown}; passes are {list(PASS_ORDER)}")
        if self.keep_logits not in (None, True, False):
            raise ValueError(f"option 'keep_logits' must be None or a bool, got {self.keep_logits!r}")
        for name in ("reduce_grads", "check_inputs", "sync_module_states", "replay_checkpoint_side_effects", "fullgraph"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"option {name!r} must be a bool, got {getattr(self, name)!r}")
        if self.dynamic not in (None, True, False):
            raise ValueError(f"option 'dynamic' must be None or a bool, got {self.dynamic!r}")
        timeout = self.timeout
        if isinstance(timeout, timedelta):
            timeout = timeout.total_seconds()
            object.__setattr__(self, "timeout", timeout)
        if timeout is not None and (isinstance(timeout, bool) or not isinstance(timeout, (int, float))
                                    or not timeout > 0 or timeout == float("inf")):
            raise ValueError(f"option 'timeout' must be a positive number of seconds, a timedelta or None, "
                             f"got {self.timeout!r}")
        budget = self.memory_budget
        if budget is not None and (isinstance(budget, bool) or not isinstance(budget, int) or budget <= 0):
            raise ValueError(f"option 'memory_budget' must be a positive int (bytes per rank) or None, got {budget!r}")
        if budget is not None and self.checkpoint != "none":
            raise ValueError(f"options 'memory_budget' and checkpoint={self.checkpoint!r} conflict: the budget picks "
                             "the checkpoint mode itself; pass one of them")
        chunk = self.lm_head_chunk_size
        if chunk is not None and (isinstance(chunk, bool) or not isinstance(chunk, int) or chunk <= 0):
            raise ValueError(f"option 'lm_head_chunk_size' must be a positive int or None, got {chunk!r}")

    @classmethod
    def from_options(cls, options: dict) -> "BurstConfig":
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(options) - known)
        if unknown:
            raise ValueError(f"unknown burstc.compile option(s) {unknown}; valid options are {sorted(known)}")
        return cls(**options)

    def cache_key(self) -> str:
        """Everything the passes depend on, for the Inductor cache key."""
        return repr(dataclasses.astuple(self))


def _check_choice(name, value, choices):
    if value not in choices:
        raise ValueError(f"option {name!r} must be one of {choices}, got {value!r}")
