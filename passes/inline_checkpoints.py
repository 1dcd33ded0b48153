"""Pass ``inline_checkpoints`` (stage dynamo, mesh only): activation-checkpointed layers become plain nodes.

Dynamo records ``torch.utils.checkpoint.checkpoint(layer, ...)`` (HF's
``gradient_checkpointing_enable()``, torchtitan's activation checkpointing) as a
``tag_activation_checkpoint`` higher-order op whose body is a separate graph.  The passes work on
one flat graph (a mask built outside a layer is read inside it; sharding flows through the layer),
so on a mesh this pass inlines every body first, tagging its nodes with their region
(``node.meta[REGION]``), and records the regions in ``context.facts.checkpoint_regions``;
``outline_checkpoints`` puts each back after the other passes.

Before::

    body = self.checkpoint_body_0
    out = tag_activation_checkpoint(body, x, use_reentrant=False)
    y = out[0]

After::

    y = <the body's nodes on x>          # each tagged meta[REGION] = 0
"""
from __future__ import annotations

import operator
from dataclasses import dataclass, field

import torch
import torch.fx as fx

CHECKPOINT = torch.ops.higher_order.tag_activation_checkpoint
REGION = "burstc_checkpoint_region"


@dataclass
class Region:
    index: int
    kwargs: dict
    body_meta: dict = field(default_factory=dict)


def _is_higher_order(node: fx.Node) -> bool:
    return node.op == "call_function" and isinstance(node.target, torch._ops.HigherOrderOperator)


def _inlinable(gm: fx.GraphModule, node: fx.Node) -> bool:
    body_node = node.args[0]
    if not (isinstance(body_node, fx.Node) and body_node.op == "get_attr"):
        return False
    body = getattr(gm, body_node.target, None)
    if not isinstance(body, fx.GraphModule):
        return False
    if any(_is_higher_order(n) or n.op in ("get_attr", "call_module") for n in body.graph.nodes):
        return False  # nested regions or state of its own: leave it whole
    placeholders = [n for n in body.graph.nodes if n.op == "placeholder"]
    tuple_uses_only = all(u.op == "call_function" and u.target is operator.getitem and isinstance(u.args[1], int)
                          for u in node.users)
    return len(placeholders) == len(node.args) - 1 and tuple_uses_only


def inline_checkpoint_regions(gm: fx.GraphModule) -> list[Region]:
    """Replace every ``tag_activation_checkpoint`` call by its body's nodes, tagged with the region."""
    regions = []
    for node in list(gm.graph.nodes):
        if not (node.op == "call_function" and node.target is CHECKPOINT and _inlinable(gm, node)):
            continue
        body_node, *operands = node.args
        body = getattr(gm, body_node.target)
        region = Region(len(regions), dict(node.kwargs), dict(getattr(body, "meta", {})))
        env = dict(zip((n for n in body.graph.nodes if n.op == "placeholder"), operands))
        outputs = ()
        with gm.graph.inserting_before(node):
            for body_op in body.graph.nodes:
                if body_op.op == "placeholder":
                    continue
                if body_op.op == "output":
                    outputs = fx.node.map_arg(body_op.args[0], lambda a: env[a])
                    continue
                copy = gm.graph.node_copy(body_op, lambda a: env[a])
                copy.meta[REGION] = region.index
                env[body_op] = copy
        outputs = outputs if isinstance(outputs, (tuple, list)) else (outputs,)
        for user in list(node.users):
            user.replace_all_uses_with(outputs[user.args[1]])
            gm.graph.erase_node(user)
        gm.graph.erase_node(node)
        if not body_node.users:
            gm.graph.erase_node(body_node)
        regions.append(region)
    return regions


def inline_checkpoints(gm: fx.GraphModule, *, config, context) -> fx.GraphModule:
    regions = inline_checkpoint_regions(gm)
    context.facts.checkpoint_regions = regions
    if regions:
        context.note = f"{len(regions)} checkpoint region(s) inlined for the passes"
    return gm
