"""What a pass may know besides its graph, and what passes hand each other: :class:`PassContext` and
:class:`GraphFacts`.

Passes never talk through string keys in ``node.meta`` / ``gm.meta``: a pass that learns something a
later pass or the backend needs puts it in ``context.facts`` as a typed value (an attention match, the
inputs a graph was specialized on, the outputs it dropped, the checkpoint regions it inlined, the
sharding it applied).  ``passes/README.md`` lists which pass produces and which consumes each fact.
"""
from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any

import torch.fx as fx

from burstc._logging import log_event
from burstc.report import Report, RewriteRecord, SkipRecord


@dataclass(frozen=True)
class ShardingFact:
    """Set by ``shard`` when it rewrote the graph for sequence parallelism."""

    world_size: int
    layout: str
    plans: tuple[str, ...]          # the backward plan of each ring attention, in graph order
    seq_len: int
    padded_len: int
    # ``(code, mask, {runtime source: placeholder position})`` per condition a ring attention is exact under, one
    # per distinct mask: its model fills hidden scores with a float the ring op can't mirror (a call where one of
    # its query rows sees no key), or its mask is exact only for contiguous padding; a call that breaks one runs
    # the unsharded graph (guards.exactness_guarded)
    call_checks: tuple = ()
    ring: str = "flat"              # "flat", or "double NxG" (nodes x ranks per node)


@dataclass
class GraphFacts:
    """Typed facts about one Dynamo graph, filled in by the passes of its pipeline run.

    - ``attention``: node -> :class:`burstc.attention_ir.AttentionMatch` (``detect_attention`` ->
      ``shard``); keyed by the SDPA node in normal form;
    - ``all_ones_inputs``: placeholder positions the graph was specialized on being all ones
      (``assume_unpadded`` -> the backend's runtime guard, :mod:`burstc.guards`);
    - ``dropped_outputs``: positions in the *original* output tuple that the graph no longer returns
      (``fuse_lm_head_loss`` -> the backend, which returns ``None`` in their place);
    - ``checkpoint_regions``: regions ``inline_checkpoints`` inlined (-> ``outline_checkpoints``);
    - ``sharding``: what ``shard`` applied, or ``None`` when the graph runs replicated (-> the backend,
      the report's summary line).
    """

    attention: dict[fx.Node, Any] = field(default_factory=dict)
    all_ones_inputs: tuple[int, ...] = ()
    dropped_outputs: tuple[int, ...] = ()
    checkpoint_regions: list = field(default_factory=list)
    sharding: ShardingFact | None = None


def module_path(node: fx.Node) -> str:
    """The module FQN a Dynamo node came from (``model.layers.0.self_attn``), or ``""``."""
    stack = node.meta.get("nn_module_stack")
    if stack:
        fqn = list(stack.values())[-1][0]
        return _clean_fqn(fqn)
    return ""


_ROOT_PREFIX = re.compile(r"^L\[[^\]]*\](\[[^\]]*\])*\.?")


def _clean_fqn(fqn: str) -> str:
    # Dynamo spells the root as L['self'] / L['args'][0] / L['s'] and may write ._modules['x']
    fqn = _ROOT_PREFIX.sub("", fqn)
    return fqn.replace("._modules['", ".").replace("_modules['", "").replace("']", "").lstrip(".")


@dataclass
class PassContext:
    """What a pass may know besides the graph: the mesh shape, the example inputs, the facts earlier
    passes established, and where to record what it did.  Passes are pure functions of (graph, config,
    world_size, facts)."""

    report: Report
    graph_id: int
    world_size: int = 1
    mesh: Any = None
    ring_groups: tuple[str, ...] = ()
    """The ring's process-group names: one (a flat ring over ``mesh``) or ``(inter, intra)`` (a double ring)."""
    example_inputs: list = field(default_factory=list)
    facts: GraphFacts = field(default_factory=GraphFacts)
    pass_name: str = ""
    note: str = ""
    _rewrites: int = 0
    _skips: int = 0

    def start_pass(self, name: str) -> None:
        self.pass_name, self.note = name, ""
        self._rewrites = self._skips = 0

    def rewrite(self, kind: str, node: fx.Node | str, details: dict | None = None, module: str | None = None):
        name = node if isinstance(node, str) else node.name
        module = module if module is not None else (module_path(node) if isinstance(node, fx.Node) else "")
        record = RewriteRecord(kind, name, module, dict(details or {}), self.graph_id, self.pass_name)
        self.report.rewrites.append(record)
        self._rewrites += 1
        log_event("rewrites", "graph %d: %s rewrote %s %s (%s) %s", self.graph_id, self.pass_name, kind, name,
                  module, record.details)
        return record

    def skip(self, kind: str, node: fx.Node | str, reason: str, module: str | None = None, *, code: str = ""):
        """Record a candidate not rewritten; ``code`` is a registered :mod:`burstc.refusals` code."""
        if code:
            from burstc.refusals import Refusal

            Refusal(code, reason)  # validates the code
        name = node if isinstance(node, str) else node.name
        module = module if module is not None else (module_path(node) if isinstance(node, fx.Node) else "")
        self.report.skipped.append(SkipRecord(kind, name, module, reason, self.graph_id, self.pass_name, code))
        self._skips += 1
        log_event("rewrites", "graph %d: %s skipped %s %s (%s): %s", self.graph_id, self.pass_name, kind, name,
                  module, reason)
