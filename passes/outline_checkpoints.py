"""Pass ``outline_checkpoints`` (stage dynamo, mesh only): the regions ``inline_checkpoints`` inlined are
checkpointed again, around whatever the passes made of their nodes.

AOTAutograd then checkpoints the rewritten layer as it would have the original (the ring attention inside
it is recomputed in the backward, communication included).  A region is outlined with the nodes the
passes put between its nodes (the ring op that replaced its SDPA, say): every node on a path from one
region node to another joins it, which keeps it convex.  A region that can't be restored that way (a node
another region owns, an in-place write) stays inlined, which is exact but keeps its activations; the report
says so (code ``pipeline.checkpoint_kept_inlined``).

Before::

    y = <the region's nodes on x, rewritten>        # meta[REGION] = 0

After::

    out = tag_activation_checkpoint(burstc_checkpoint_body_0, x, use_reentrant=False)
    y = out[0]
"""
from __future__ import annotations

import operator

import torch
import torch.fx as fx

from burstc.passes.graph_utils import is_mutating, val
from burstc.passes.inline_checkpoints import CHECKPOINT, REGION, Region
from burstc.refusals import PIPELINE



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


_VMAP_LEVEL = ("_vmap_increment_nesting", "_vmap_decrement_nesting")


def _with_whole_vmap_levels(gm: fx.GraphModule, region_nodes: set[fx.Node]) -> set[fx.Node]:
    """``region_nodes`` and, for every vmap level one of them runs in (FlexAttention's ``create_block_mask`` vmaps
    its mask_mod inside the layer), every node of that level from its increment to its decrement: functorch's level
    stack must open and close on the same side of the region's boundary (half a level inside failed with
    ``!dynamicLayerStack.empty()``; fuzz seed 282 case 36)."""
    spans, stack, current = [], [], []
    for node in gm.graph.nodes:
        name = getattr(node.target, "__name__", "") if node.op == "call_function" else ""
        if name == _VMAP_LEVEL[0]:
            stack.append(len(current))
        if stack:
            current.append(node)
        if name == _VMAP_LEVEL[1] and stack:
            stack.pop()
            if not stack:  # the outermost level closed: one span
                spans.append(current)
                current = []
    found = set(region_nodes)
    for span in spans:
        if found.intersection(span):
            found.update(span)
    return found


def outline_checkpoint_regions(gm: fx.GraphModule, regions: list[Region]) -> tuple[list[str], list[str]]:
    """Put every region back into a ``tag_activation_checkpoint`` call; -> (restored, kept_inlined):
    a line per region saying what it holds, or why it stays inlined."""
    restored, kept = [], []
    for region in regions:
        members = {n for n in gm.graph.nodes if n.meta.get(REGION) == region.index}
        if not members:
            continue
        region_nodes = _with_whole_vmap_levels(gm, _closure(members))
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



def outline_checkpoints(gm: fx.GraphModule, *, config, context) -> fx.GraphModule:
    regions = context.facts.checkpoint_regions
    if not regions:
        return gm
    restored, kept = outline_checkpoint_regions(gm, regions)
    for line in restored:
        context.rewrite("checkpoint_region", "graph", {"restored": line}, module="")
    for line in kept:
        context.skip("checkpoint_region", "graph", line, module="", code=PIPELINE.checkpoint_kept_inlined)
    return gm
