"""burstc's graph passes, one per file, each ``gm -> gm`` with keyword-only ``config`` and ``context``.

They run in ``PASS_ORDER`` on the Dynamo (torch-level) graph, before AOTAutograd; see README.md here for
the invariants every pass keeps.  ``burstc.compile(..., disable_passes=[name])`` skips one.
"""
from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any, Callable

import torch.fx as fx

from burstc._logging import log_event
from burstc.report import PassRun, Report, RewriteRecord, SkipRecord

# Order matters: the LM-head fusion matches the unsharded loss; shard then lowers the fused op's
# normalizer to the global token count; assume_unpadded turns masks built from an all-ones
# attention_mask input into constants (behind a runtime check) that detect_attention folds;
# detect_attention puts attention in the SDPA normal form that shard lowers to ring attention.
PASS_ORDER: tuple[str, ...] = ("fuse_lm_head_loss", "assume_unpadded", "detect_attention", "shard")


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
    """What a pass may know besides the graph: the mesh shape, the example inputs, and where to
    record what it did.  Passes are pure functions of (graph, config, world_size)."""

    report: Report
    graph_id: int
    world_size: int = 1
    mesh: Any = None
    example_inputs: list = field(default_factory=list)
    pass_name: str = ""
    note: str = ""
    _rewrites: int = 0
    _skips: int = 0

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


def _registry() -> dict[str, Callable]:
    from burstc.passes.assume_unpadded import assume_unpadded
    from burstc.passes.detect_attention import detect_attention
    from burstc.passes.fuse_lm_head_loss import fuse_lm_head_loss
    from burstc.passes.shard import shard

    passes = {"fuse_lm_head_loss": fuse_lm_head_loss, "assume_unpadded": assume_unpadded,
              "detect_attention": detect_attention, "shard": shard}
    assert tuple(passes) == PASS_ORDER
    return passes


def apply_passes(gm: fx.GraphModule, *, config, context: PassContext) -> fx.GraphModule:
    for name, pass_fn in _registry().items():
        if name in config.disable_passes:
            context.report.passes.append(PassRun(name, context.graph_id, 0, 0, "disabled by option"))
            continue
        context.pass_name = name
        context._rewrites = context._skips = 0
        context.note = ""
        result = pass_fn(gm, config=config, context=context)
        if not isinstance(result, fx.GraphModule):
            raise TypeError(f"burstc pass {name} returned {type(result).__name__}, expected a GraphModule")
        gm = result
        note = context.note or ("" if context._rewrites or context._skips else "found no candidates")
        context.report.passes.append(PassRun(name, context.graph_id, context._rewrites, context._skips, note))
        log_event("passes", "graph %d: pass %s: %d rewrite(s), %d skip(s) %s", context.graph_id, name,
                  context._rewrites, context._skips, note)
    gm.graph.lint()
    gm.recompile()
    return gm
