"""Activation-checkpoint regions around the burstc passes: inlined before, restored after.

Dynamo records ``torch.utils.checkpoint.checkpoint(layer, ...)`` (HF's
``gradient_checkpointing_enable()``, torchtitan's activation checkpointing) as a
``tag_activation_checkpoint`` higher-order op whose body is a separate graph.  The passes work on
one flat graph (a mask built outside a layer is read inside it; sharding flows through the layer),
so on a mesh the backend inlines every body first, tagging its nodes with their region, and after
the passes outlines each region again into a new body with the original op's arguments.  AOTAutograd
then checkpoints the rewritten layer as it would have the original (the ring attention inside
it is recomputed in the backward, communication included).

A region is outlined with the nodes the passes put between its nodes (the ring op that replaced its
SDPA, say): every node on a path from one region node to another joins it, which keeps it convex.
A region that can't be restored that way (a node another region owns, an in-place write) stays
inlined, which is exact but keeps its activations; the report says so.
"""
from __future__ import annotations

import operator
from dataclasses import dataclass, field

import torch
import torch.fx as fx

from burstc.passes.graph_utils import is_mutating, val

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


def _reachable(starts, neighbours) -> set[fx.Node]:
    """Every node reached from ``starts`` by one or more ``neighbours(node)`` steps."""
    seen, stack = set(), list(starts)
    while stack:
        for nxt in neighbours(stack.pop()):
            if nxt not in seen:
                seen.add(nxt)
                stack.append(nxt)
    return seen


def _closure(members: set[fx.Node]) -> set[fx.Node]:
    """``members`` and every node on a path between two of them."""
    downstream = _reachable(members, lambda n: n.users)
    upstream = _reachable(members, lambda n: n.all_input_nodes)
    return members | (downstream & upstream)


def outline_checkpoint_regions(gm: fx.GraphModule, regions: list[Region]) -> tuple[list[str], list[str]]:
    """Put every region back into a ``tag_activation_checkpoint`` call; -> (restored, kept_inlined):
    a line per region saying what it holds, or why it stays inlined."""
    restored, kept = [], []
    for region in regions:
        members = {n for n in gm.graph.nodes if n.meta.get(REGION) == region.index}
        if not members:
            continue
        region_nodes = _closure(members)
        strangers = [n for n in region_nodes - members
                     if n.op not in ("call_function", "call_method") or n.meta.get(REGION, region.index) != region.index]
        if strangers or any(is_mutating(n) for n in region_nodes):
            why = (f"`{strangers[0].name}` would have to join it" if strangers else "it writes in place")
            kept.append(f"checkpoint region {region.index} stays inlined ({why}): exact, without recomputation")
            continue
        restored.append(_outline(gm, region, region_nodes))
    gm.graph.lint()
    gm.recompile()
    return restored, kept


def _outline(gm: fx.GraphModule, region: Region, region_nodes: set[fx.Node]) -> str:
    graph = gm.graph
    ordered = [n for n in graph.nodes if n in region_nodes]
    inputs = list(dict.fromkeys(i for n in ordered for i in n.all_input_nodes if i not in region_nodes))
    outputs = [n for n in ordered if any(u not in region_nodes for u in n.users)]

    body_graph = fx.Graph()
    env = {}
    for inp in inputs:
        placeholder = body_graph.placeholder(inp.name)
        placeholder.meta.update({k: v for k, v in inp.meta.items() if k in ("example_value", "val", "tensor_meta")})
        env[inp] = placeholder
    for n in ordered:
        env[n] = body_graph.node_copy(n, lambda a: env[a])
        env[n].meta.pop(REGION, None)
    body_graph.output(tuple(env[n] for n in outputs))
    body = fx.GraphModule(torch.nn.Module(), body_graph)
    body.meta.update(region.body_meta)
    name = f"burstc_checkpoint_body_{region.index}"
    while hasattr(gm, name):
        name += "_"
    gm.add_submodule(name, body)

    last = ordered[-1]
    with graph.inserting_after(last):
        body_attr = graph.get_attr(name)
    with graph.inserting_after(body_attr):
        call = graph.call_function(CHECKPOINT, (body_attr, *inputs), dict(region.kwargs))
    call.meta["example_value"] = tuple(val(n) for n in outputs)
    cursor = call
    results = []
    for i, out in enumerate(outputs):
        with graph.inserting_after(cursor):
            cursor = graph.call_function(operator.getitem, (call, i))
        cursor.meta.update({k: v for k, v in out.meta.items() if k != REGION})
        results.append(cursor)
    for out, result in zip(outputs, results):
        out.replace_all_uses_with(result, delete_user_cb=lambda user: user not in region_nodes)
    # outside nodes that read a region output but sat before the region's last node move after it;
    # none of them feeds the region (it would be on a path between region nodes, hence in it)
    moved = set(results)
    for n in list(graph.nodes):
        if n is call:
            break
        if n not in region_nodes and any(i in moved for i in n.all_input_nodes):
            cursor.append(n)
            cursor = n
            moved.add(n)
    for n in reversed(ordered):
        graph.erase_node(n)
    kinds = sorted({getattr(n.target, "__name__", str(n.target)) for n in ordered
                    if n.op == "call_function" and "burstc" in str(n.target)})
    return (f"checkpoint region {region.index}: {len(ordered)} ops, {len(inputs)} inputs, {len(outputs)} outputs"
            + (f" (holds {', '.join(kinds)})" if kinds else ""))
