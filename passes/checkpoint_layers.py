"""Pass ``checkpoint_layers`` (stage dynamo): the ``checkpoint=`` option — burstc's own activation checkpointing of
the decoder layers, for a model that does none itself (or to make a user's checkpointing selective), on a mesh
and on one device (there the attention kept by ``"selective"`` is SDPA's kernel output).

- ``"none"`` (default): nothing; a user's own checkpointing stays as it was (its ring attention recomputed).
- ``"layers"``: every decoder layer is recomputed in the backward, saving only its inputs.  Layers are
  found from the graph's module paths, no model change: the repeated entries of a module list or dict
  (``model.layers.3``, ``transformer.h.3``) whose nodes hold an attention (a ring attention once sharded).
- ``"selective"``: the same regions, but each keeps its ring attention's outputs (O and LSE: ``B·H·s·(D+1)``
  values per layer for ``s`` local tokens), so the recomputation runs the layer's projections, norms and
  MLP again and never the ring — no attention compute and no communication in the backward's recompute
  (BurstEngine's sequence-level selective checkpointing with the whole local sequence kept).  A user's own
  checkpointed layers get the same policy unless they set a ``context_fn`` of their own.

With ``memory_budget=`` the layers are tagged as for ``"selective"`` and the nodes of the regions added here
carry ``meta["custom"][BURSTC_LAYER]``: the partitioner (:func:`burstc.memory.partition_within_budget`) then
derives the three modes' forward and backward graphs from the one joint graph and keeps the cheapest that fits.

Regions are tagged here (``node.meta[REGION]``, as ``inline_checkpoints`` tags a user's) and put into
``tag_activation_checkpoint`` calls by ``outline_checkpoints``; the selective policy is the body's
``_checkpoint_context_fn``, which AOTAutograd's partitioner reads (torch's selective activation checkpointing).
"""
from __future__ import annotations

import functools
import re
from collections import defaultdict

import torch
import torch.fx as fx

from burstc.passes.inline_checkpoints import REGION, Region

KIND = "checkpoint_layers"
BURSTC_LAYER = "burstc_checkpoint_layer"  # meta["custom"] key of a node in a region this pass added
_ROOT = re.compile(r"^[LG]\['[^']*'\](\[\d+\])*\.?")  # Dynamo's name for the traced root module: L['self'].
_INDEXED = re.compile(r"^(?P<prefix>.+?)(?:\.|\[')?(?P<index>\d+)(?:'\])?$")


# the attention ops whose outputs a selective region keeps: the ring op, and SDPA's kernels (one device, or a
# graph that stays replicated)
_SDPA_KERNELS = ("_scaled_dot_product_flash_attention_for_cpu", "_scaled_dot_product_flash_attention",
                 "_scaled_dot_product_efficient_attention", "_scaled_dot_product_cudnn_attention",
                 "_scaled_dot_product_fused_attention_overrideable")
KEPT_ATTENTION_OPS = frozenset([torch.ops.burstc.ring_attention_forward.default] + [
    getattr(torch.ops.aten, name).default for name in _SDPA_KERNELS if hasattr(torch.ops.aten, name)])


def _keep_attention(ctx, op, *args, **kwargs):
    """Selective policy: the attention's outputs are saved (the ring op's, or SDPA's kernel's), everything else
    recomputed."""
    from torch.utils.checkpoint import CheckpointPolicy

    if op in KEPT_ATTENTION_OPS:
        return CheckpointPolicy.MUST_SAVE
    return CheckpointPolicy.PREFER_RECOMPUTE


def selective_context_fn():
    from torch.utils.checkpoint import create_selective_checkpoint_contexts

    return functools.partial(create_selective_checkpoint_contexts, _keep_attention)


def _layer_of(node: fx.Node, repeated: set[str]) -> tuple[str, str] | None:
    """(list path, index) of the outermost repeated module ``node`` runs in, else None."""
    for path, _ in (node.meta.get("nn_module_stack") or {}).values():
        found = _INDEXED.match(path)
        if found and found["prefix"] in repeated:
            return found["prefix"], found["index"]
    return None


def _attention_nodes(gm: fx.GraphModule, context) -> list[fx.Node]:
    """The nodes that carry each attention's module path: the ring ops' outputs (the shard pass inserted the op;
    its output carries the replaced attention's path), else, in a graph not sharded (one device), the
    attentions detection recorded (SDPA calls, manual ``probs @ v``)."""
    ring = [user for node in gm.graph.nodes
            if node.op == "call_function" and node.target is torch.ops.burstc.ring_attention_forward.default
            for user in node.users]
    if ring:
        return ring
    return [node for node in context.facts.attention if not getattr(node, "_erased", False) and node.graph is gm.graph]


def _repeated_module_lists(gm: fx.GraphModule, context) -> set[str]:
    """Module-path prefixes with at least two indexed children holding an attention."""
    indices = defaultdict(set)
    for node in _attention_nodes(gm, context):
        for path, _ in (node.meta.get("nn_module_stack") or {}).values():
            found = _INDEXED.match(path)
            if found:
                indices[found["prefix"]].add(found["index"])
                break
    return {prefix for prefix, seen in indices.items() if len(seen) >= 2}


def checkpoint_layers(gm: fx.GraphModule, *, config, context) -> fx.GraphModule:
    planning = config.memory_budget is not None
    mode = "selective" if planning else config.checkpoint
    regions = context.facts.checkpoint_regions
    if mode == "none":
        context.note = "checkpoint='none': layers are not checkpointed by burstc"
        return gm
    body_meta = {"_checkpoint_context_fn": selective_context_fn()} if mode == "selective" else {}
    made_selective = 0
    if mode == "selective":
        for region in regions:  # the user's own checkpointed layers keep their ring attention too
            if "_checkpoint_context_fn" not in region.body_meta:
                region.body_meta.update(body_meta)
                made_selective += 1
    repeated = _repeated_module_lists(gm, context)
    members = defaultdict(list)
    for node in gm.graph.nodes:
        if node.op in ("call_function", "call_method"):
            layer = _layer_of(node, repeated)
            if layer is not None:
                members[layer].append(node)
    added = []
    for (prefix, index), nodes in members.items():
        if any(REGION in n.meta for n in nodes):
            continue  # the user checkpoints this layer already
        region = Region(len(regions) + len(added), {"use_reentrant": False}, dict(body_meta))
        for n in nodes:
            n.meta[REGION] = region.index
            if planning:  # the partitioner may drop this region again (meta["custom"] reaches the joint graph)
                n.meta["custom"] = {**(n.meta.get("custom") or {}), BURSTC_LAYER: region.index}
        added.append(region)
        layer = _ROOT.sub("", f"{prefix}.{index}")
        details = {"layer": layer, "mode": "memory_budget" if planning else mode, "ops": len(nodes)}
        context.rewrite(KIND, nodes[-1], details, module=layer)
    context.facts.checkpoint_regions = list(regions) + added
    if planning:
        context.note = (f"memory_budget={config.memory_budget}: {len(added)} layer(s) tagged, the partitioner "
                        "picks the checkpoint mode")
    elif not added and not made_selective:
        context.note = f"checkpoint={mode!r}: no repeated layer holding an attention found"
    else:
        context.note = (f"checkpoint={mode!r}: {len(added)} layer(s) tagged for recomputation"
                        + (f", {made_selective} of the model's own made selective" if made_selective else "")
                        + ("; ring attention outputs kept (not recomputed)" if mode == "selective" else ""))
    return gm
