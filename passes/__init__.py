"""burstc's graph passes: one registry, one file per pass, each ``gm -> gm`` with keyword-only ``config``
and ``context``.

A pass is declared in :data:`PASSES` with its stage, whether it needs a mesh, and the facts it produces
and consumes (``context.facts``, :class:`burstc.pass_context.GraphFacts`).  The stages run in this order
(``burstc/backend.py`` and ``burstc/lowering.py``)::

    Dynamo graph ─► "dynamo" passes ─► AOTAutograd (joint graph, burstc's partitioner hook)
                 ─► "aot_forward" passes on the forward graph ─► Inductor / aot_eager
                 ─► "aot_backward" passes on the backward graph ─► Inductor / aot_eager

``burstc.compile(..., disable_passes=[name])`` skips a pass; the report keeps the graph after every
pass (``burstc.report(m).graphs[graph_id][pass_name]``).  See README.md here for the invariants.
"""
from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import Callable

import torch.fx as fx

from burstc._logging import dump_graph, log_event
from burstc.pass_context import GraphFacts, PassContext, ShardingFact, module_path  # noqa: F401  (re-exported)
from burstc.report import PassRun, snapshot_graph

STAGES = ("dynamo", "aot_forward", "aot_backward")


@dataclass(frozen=True)
class PassSpec:
    """One registered pass: ``passes/<name>.py`` defines the function ``<name>``."""

    name: str
    stage: str
    needs_mesh: bool
    summary: str
    produces: tuple[str, ...] = ()
    consumes: tuple[str, ...] = ()
    function: Callable | None = None
    """The pass itself, for a pass defined outside ``passes/`` (a plugin, a test); else loaded by name."""
    one_device_when: Callable | None = None
    """A pass that needs a mesh still runs on one device when this is true of the config (``checkpoint=``)."""

    def runs(self, config, world_size: int) -> bool:
        return not self.needs_mesh or world_size > 1 or (self.one_device_when is not None
                                                         and bool(self.one_device_when(config)))

    def __post_init__(self):
        if self.stage not in STAGES:
            raise ValueError(f"pass {self.name!r}: unknown stage {self.stage!r}; stages are {STAGES}")

    def load(self) -> Callable:
        if self.function is not None:
            return self.function
        return getattr(importlib.import_module(f"burstc.passes.{self.name}"), self.name)


# Order matters.  The passes must see inside checkpointed layers on a mesh (sharding flows through
# them), so inline_checkpoints runs first and outline_checkpoints last.  The LM-head fusion matches the
# unsharded loss; shard then lowers the fused op's normalizer to the global token count.
# assume_unpadded turns masks built from an all-ones attention_mask input into constants (behind a
# runtime guard) that detect_attention folds; detect_attention puts attention in the SDPA normal form
# and records one AttentionMatch per attention, which shard lowers to ring attention.
def _checkpointing(config) -> bool:
    """burstc's own checkpointing asked for: its passes run on one device too (layers found, tagged, restored)."""
    return getattr(config, "checkpoint", "none") != "none"


PASSES: tuple[PassSpec, ...] = (
    PassSpec("inline_checkpoints", "dynamo", True,
             "activation-checkpointed layers inlined, their nodes tagged with their region",
             produces=("checkpoint_regions",), one_device_when=_checkpointing),
    PassSpec("fuse_lm_head_loss", "dynamo", False,
             "LM head + cross-entropy -> burstc::linear_cross_entropy (no [tokens, vocab] logits)",
             produces=("dropped_outputs",)),
    PassSpec("assume_unpadded", "dynamo", True,
             "an all-ones attention_mask input assumed, behind a runtime guard",
             produces=("all_ones_inputs",)),
    PassSpec("detect_attention", "dynamo", True,
             "attention in SDPA normal form, one AttentionMatch (with its MaskSpec) per attention",
             produces=("attention",), one_device_when=_checkpointing),
    PassSpec("shard", "dynamo", True,
             "sequence-parallel lowering: this rank's tokens, ring attention, global loss normalizer",
             consumes=("attention", "dropped_outputs"), produces=("sharding",)),
    PassSpec("share_replicated_grads", "dynamo", True,
             "reduce_grads=False on a graph that runs replicated: each parameter gradient divided by P, so the "
             "ranks' gradients sum to the whole as a sharded graph's do", consumes=("sharding",)),
    PassSpec("checkpoint_layers", "dynamo", True,
             "checkpoint='layers' / 'selective': decoder layers tagged for recomputation (selective: the ring "
             "attention's outputs kept)", consumes=("sharding", "checkpoint_regions"),
             produces=("checkpoint_regions",), one_device_when=_checkpointing),
    PassSpec("outline_checkpoints", "dynamo", True,
             "inlined checkpoint regions restored around the rewritten nodes",
             consumes=("checkpoint_regions",), one_device_when=_checkpointing),
    PassSpec("overlap_ring_backward", "aot_backward", True,
             "each ring backward split at its last hop (start / finish nodes), the weight gradients computed before "
             "it moved into the hop"),
    PassSpec("prefetch_ring_backward", "aot_backward", True,
             "each ring backward's first transfer (what of it exists before the backward: K/V, or Q and the LSE) "
             "posted from a node of its own, right after the previous ring backward"),
    PassSpec("schedule", "aot_backward", True,
             "parameter-gradient all-reduces bucketed (grad_bucket_bytes), issued as soon as a bucket's gradients "
             "exist, waited at the end of the backward"),
)
PASS_ORDER: tuple[str, ...] = tuple(p.name for p in PASSES)


def passes_of(stage: str) -> tuple[PassSpec, ...]:
    if stage not in STAGES:
        raise ValueError(f"unknown stage {stage!r}; stages are {STAGES}")
    return tuple(p for p in PASSES if p.stage == stage)


def run_stage(stage: str, gm: fx.GraphModule, *, config, context: PassContext, graphs: dict | None = None
              ) -> fx.GraphModule:
    """Run ``stage``'s passes in order on ``gm``; each leaves a :class:`PassRun` in the report (a pass that
    finds nothing says so) and, when ``graphs`` is given, a snapshot of the graph after it."""
    ran = False
    for spec in passes_of(stage):
        if spec.name in config.disable_passes:
            _record_run(context, spec.name, 0, 0, "disabled by option")
            continue
        if not spec.runs(config, context.world_size):
            _record_run(context, spec.name, 0, 0, "single device: not run (needs a mesh)")
            continue
        context.start_pass(spec.name)
        ran = True
        result = spec.load()(gm, config=config, context=context)
        if not isinstance(result, fx.GraphModule):
            raise TypeError(f"burstc pass {spec.name} returned {type(result).__name__}, expected a GraphModule")
        gm = result
        note = context.note or ("" if context._rewrites or context._skips else "found no candidates")
        _record_run(context, spec.name, context._rewrites, context._skips, note)
        if graphs is not None:
            graphs[spec.name] = snapshot_graph(gm)
            dump_graph(spec.name, context.graph_id, gm)
    if ran:  # an AOT stage without passes hands its graph on untouched (no codegen for nothing)
        gm.graph.lint()
        gm.recompile()
    return gm


def _record_run(context: PassContext, name: str, rewrites: int, skips: int, note: str) -> None:
    context.report.passes.append(PassRun(name, context.graph_id, rewrites, skips, note))
    log_event("passes", "graph %d: pass %s: %d rewrite(s), %d skip(s) %s", context.graph_id, name,
              rewrites, skips, note)
