"""burstc.compile options: one keyword-only, validated dataclass."""
from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass, field, fields
from datetime import timedelta

from burstc.layout import LAYOUT_OPTIONS

BACKENDS = ("inductor", "aot_eager")
ATTENTION_PLANS = ("auto", "kv_ring", "burst")
CHECKPOINT_MODES = ("none", "layers", "selective")
RING_KINDS = ("auto", "flat", "double", "ulysses")


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

    layout: str = "auto"
    """Sequence layout over the mesh: ``contiguous``, ``zigzag``, ``striped``, ``documents`` (:mod:`burstc.layout`),
    or ``"auto"`` (default): per graph, one for all its ring attentions (layers with different masks share the
    token layout; :func:`burstc.cost_model.choose_layout`).  Packed documents (every attention causal over document
    ids, no window, a flat ring): ``documents``, each call's chunks assigned from its ids so the document-causal
    work is even (:mod:`burstc.balance_documents`).  Otherwise, without a sliding window, the least work on the
    busiest rank (causal: ``zigzag``, exactly even); with one, the cost model's fastest (a window no longer than a
    shard: ``contiguous``, which exchanges only the halo; Gemma-3-style window and full layers: the total decides).
    The report's shard rewrite gives the reason and each candidate's numbers (``layout_reason``,
    ``layout_candidates``)."""

    seq_dims: tuple[str, ...] | None = None
    """Names of the mesh dims that shard the sequence (``None``: every dim).  With two, the first spans nodes
    and the second the ranks of a node (a ``("inter", "intra")`` mesh), and the tokens follow the
    flattened, node-major order.  Other dims (data parallel, ``("dp", "cp")`` with ``seq_dims=("cp",)``)
    are the user's: burstc works inside each of their groups, as on ``mesh["cp"]``."""

    ring: str = "auto"
    """Ring over the sequence dims: ``"flat"`` (one ring over the flattened dims), ``"double"`` (two sequence
    dims of at least 2 ranks each: intra-node steps with each inter-node transfer hidden behind them,
    :mod:`burstc.ops.double_ring`), ``"ulysses"`` (all-to-all inside the node, a ring across nodes:
    :mod:`burstc.ops.ulysses`; where the heads divide, else the double ring), or ``"auto"`` (on two sequence dims,
    per attention the fastest of the three by the cost model, :mod:`burstc.cost_model`; else flat)."""

    link_bandwidth: dict | tuple | None = None
    """Bytes per second of a link, ``{"intra": ..., "inter": ...}``, for the cost model that picks the ring under
    ``ring="auto"`` (:mod:`burstc.cost_model`); missing classes keep the defaults: NVLink 450e9 and InfiniBand
    50e9 on CUDA, the emulated cluster's calibration on CPU (101e6 and 11.3e6, with ``compute_flops`` 45e9)."""

    compute_flops: float | None = None
    """Attention FLOP/s of one device for the cost model (default 400e12 on CUDA, 45e9 on CPU)."""

    attention_plan: str = "auto"
    """Ring-attention backward plan: ``auto`` (planner's cheaper one), ``kv_ring`` or ``burst``."""

    reduce_grads: bool = True
    """Sum parameter gradients over the sequence mesh inside the compiled backward."""

    grad_bucket_bytes: int = 25 * 2**20
    """On a mesh, with ``reduce_grads``: the ``schedule`` pass sums parameter gradients over the sequence ranks in
    buckets of at most this many bytes (DDP's default, 25 MiB), each issued as soon as its gradients exist and
    waited for at the end of the backward; ``0`` keeps one all-reduce per gradient (still waited late)."""

    overlap_memory_bytes: int | None = None
    """On a mesh: the ``overlap_ring_backward`` pass moves weight gradients into each ring backward's last hop while
    the bytes whose lifetime that extends past the ring call's start stay within this many (the most it raises the
    step's peak); ``None``: per call, what the call holds through its hop anyway (its fp32 dQ, dK, dV and the hop's
    receive buffer); ``0`` moves nothing (as ``disable_passes=["overlap_ring_backward"]``)."""

    prefetch_ring_backward: bool = True
    """On a mesh: the ``prefetch_ring_backward`` pass posts each ring backward's first transfer (what of it the
    forward saved: K and V, or Q and the LSE) from a node of its own, right after the previous ring backward, so it
    travels behind the layer's MLP backward (measured on 2 gloo ranks at 11.3 MB/s: the step 6.5% faster; with
    links not limited, nothing to hide: the same within noise).  ``False`` posts it when the backward starts."""

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
    """Activation checkpointing burstc adds (``passes/checkpoint_layers.py``), on a mesh or one device:
    ``"none"``, ``"layers"`` (each decoder layer recomputed in the backward, ring attention included) or
    ``"selective"`` (layers recomputed, each ring attention's output and LSE kept: the recomputation never runs
    the ring; on one device SDPA's output is kept)."""

    checkpoint_keep: float = 1.0
    """Under ``checkpoint="selective"``, the fraction of each rank's local rows whose ring-attention output and LSE
    are kept (:mod:`burstc.kept_rows`): the last rows in local order (under a causal mask the costliest); the
    backward's recompute runs the ring forward for the others only (their compute, and only the key rows they see
    travel).  ``1.0`` (default) keeps every row: the recompute never runs the ring."""

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

    trace: str | None = None
    """A directory: every call of the compiled model but the first (which compiles) writes a Perfetto/Chrome
    trace per rank there, ``rank{R}-call{N}.json``, with named spans for each ring step and transfer
    (:mod:`burstc.timeline`).  ``None`` (default): the ``BURSTC_TRACE`` environment variable's directory, if set."""

    def __post_init__(self):
        from burstc.passes import PASS_ORDER

        _check_choice("backend", self.backend, BACKENDS)
        _check_choice("layout", self.layout, LAYOUT_OPTIONS)
        _check_choice("attention_plan", self.attention_plan, ATTENTION_PLANS)
        _check_choice("checkpoint", self.checkpoint, CHECKPOINT_MODES)
        _check_choice("ring", self.ring, RING_KINDS)
        if self.link_bandwidth is not None:
            bandwidth = self.link_bandwidth
            if isinstance(bandwidth, tuple):  # dataclasses.replace of a validated config
                bandwidth = dict(bandwidth)
            if (not isinstance(bandwidth, dict) or set(bandwidth) - {"intra", "inter"}
                    or not all(_positive_number(x) for x in bandwidth.values())):
                raise ValueError("option 'link_bandwidth' must be a dict of positive bytes/s under 'intra' and/or "
                                 f"'inter', got {bandwidth!r}")
            # stored as sorted items: the config stays hashable
            object.__setattr__(self, "link_bandwidth", tuple(sorted(bandwidth.items())))
        if self.compute_flops is not None and not _positive_number(self.compute_flops):
            raise ValueError(f"option 'compute_flops' must be a positive number, got {self.compute_flops!r}")
        if self.seq_dims is not None:
            dims = (self.seq_dims,) if isinstance(self.seq_dims, str) else self.seq_dims
            if (not isinstance(dims, (tuple, list)) or not dims or not all(isinstance(d, str) for d in dims)
                    or len(set(dims)) != len(dims)):
                raise ValueError(f"option 'seq_dims' must be None or distinct mesh dim names, got {self.seq_dims!r}")
            object.__setattr__(self, "seq_dims", tuple(dims))
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
        if self.trace is not None:
            if isinstance(self.trace, bytes) or not isinstance(self.trace, (str, os.PathLike)) or not str(self.trace):
                raise ValueError(f"option 'trace' must be a directory path or None, got {self.trace!r}")
            object.__setattr__(self, "trace", os.fspath(self.trace))
        bucket = self.grad_bucket_bytes
        if isinstance(bucket, bool) or not isinstance(bucket, int) or bucket < 0:
            raise ValueError(f"option 'grad_bucket_bytes' must be a non-negative int, got {bucket!r}")
        overlap = self.overlap_memory_bytes
        if overlap is not None and (isinstance(overlap, bool) or not isinstance(overlap, int) or overlap < 0):
            raise ValueError(f"option 'overlap_memory_bytes' must be a non-negative int or None, got {overlap!r}")
        if not isinstance(self.prefetch_ring_backward, bool):
            raise ValueError(f"option 'prefetch_ring_backward' must be True or False, got "
                             f"{self.prefetch_ring_backward!r}")
        budget = self.memory_budget
        if budget is not None and (isinstance(budget, bool) or not isinstance(budget, int) or budget <= 0):
            raise ValueError(f"option 'memory_budget' must be a positive int (bytes per rank) or None, got {budget!r}")
        if budget is not None and self.checkpoint != "none":
            raise ValueError(f"options 'memory_budget' and checkpoint={self.checkpoint!r} conflict: the budget picks "
                             "the checkpoint mode itself; pass one of them")
        keep = self.checkpoint_keep
        if isinstance(keep, bool) or not isinstance(keep, (int, float)) or not 0 < keep <= 1:
            raise ValueError(f"option 'checkpoint_keep' must be a fraction in (0, 1], got {keep!r}")
        if keep < 1 and self.checkpoint != "selective":
            raise ValueError(f"option checkpoint_keep={keep!r} applies to checkpoint='selective' (the fraction of each "
                             f"attention's output it keeps), got checkpoint={self.checkpoint!r}")
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


def _positive_number(x) -> bool:
    return not isinstance(x, bool) and isinstance(x, (int, float)) and 0 < x < float("inf")


def _check_choice(name, value, choices):
    if value not in choices:
        raise ValueError(f"option {name!r} must be one of {choices}, got {value!r}")
