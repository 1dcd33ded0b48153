"""Pass ``overlap_ring_backward`` (stage aot_backward, mesh only): each ring backward split at its last hop, and
weight gradients computed before it moved into the hop.

A ring backward ends by sending the last visitor's gradients home (dQ on the burst plan, dK and dV on
``kv_ring``: :mod:`burstc.ops.ring_loops`) and waiting for its own: one transfer with nothing beside it, since
everything after the call reads its gradients (the layer's input gradient needs dQ, dK and dV, and the layer
below needs that, so no compute of layer L-1's backward can run during layer L's last hop).  What needs none of
them is the weight gradients: ``dW = X^T dY`` of the layers whose backward already ran (the MLP and output
projection of the same decoder layer, the layer above's attention projections) feed only the graph's outputs
(and, on a mesh, their gradient all-reduces).  So this pass:

1. replaces each ``burstc::ring_attention_backward`` with ``burstc::ring_attention_backward_start`` (the whole
   backward, its last hop posted and not waited for; returns a token) and ``..._finish`` (waits, returns
   ``(dq, dk, dv)``);
2. moves *deferrable* nodes placed before the start (since the previous ring backward) to between the start and
   the finish, in their order.  A node is deferrable when every reader is deferrable or the graph's output: the
   weight-gradient subgraphs (matmul, transposes, bias sums).

A gradient all-reduced inside the graph (``reduce_grads=True``, the default on a mesh) does not move: its sum is
issued as soon as it exists, and delaying it cost more than the hidden hop gained (measured, 2 ranks under the
emulated network: the hop's exposed wait fell 3.8 -> 2.0 s and the step rose 51.3 -> 52.4 s).  So the pass
moves work where the gradients are reduced outside the graph (``reduce_grads=False``: FSDP, DDP), and otherwise
reports each ring backward with ``overlap.gradients_reduced``.

Memory, the bound: a moved node's inputs live until it runs, past the start, where they would have died before
it.  The nodes nearest the start are taken first, each only while the bytes whose lifetime now spans the ring
call stay within ``config.overlap_memory_bytes`` (default: what the call itself holds through its hop, its fp32
gradients and the hop's receive buffer, :func:`burstc.memory.pending_backward_buffers`), so a split raises the
step's peak by at most that much (one split's moved nodes all run before its finish: their extensions never add
up).  The report gives each split's moved nodes and extended bytes.  A ring backward with nothing it may move is
left whole (``overlap.nothing_to_overlap``).  Nothing is computed differently, only later: results are
bit-identical to the unsplit graph.  Nodes never move past a mutating or side-effecting node.
"""
from __future__ import annotations

import dataclasses
from typing import Callable

import torch
import torch.fx as fx

from burstc.passes.graph_utils import fake_mode_of, propagate_meta, val
from burstc.refusals import register_codes

KIND = "overlap_ring_backward"
CODES = register_codes("overlap", {
    "nothing_to_overlap": "no weight gradient computed before this ring backward can move into its last hop "
                          "(none since the previous one, or none within overlap_memory_bytes)",
    "gradients_reduced": "the weight gradients before this ring backward are all-reduced inside the graph "
                         "(reduce_grads=True): moving them would delay their sums, which measured slower than "
                         "the hop they would hide",
})
_FUNCOL = torch.ops._c10d_functional
_COLLECTIVES = (_FUNCOL.all_reduce.default, _FUNCOL.wait_tensor.default)


def ring_backward_target():
    import burstc.ops.ring_attention  # noqa: F401  (registers the ops)

    return torch.ops.burstc.ring_attention_backward.default


def _mutates_or_side_effects(node: fx.Node) -> bool:
    if node.op != "call_function" or node.target in _COLLECTIVES:  # a gradient's sum: stays, moves nothing else
        return False
    schema = getattr(node.target, "_schema", None)
    return (schema is not None and schema.is_mutable) or node.is_impure()


def _movable(node: fx.Node) -> bool:
    # burstc's ops stay where they are; so do the gradients' all-reduces (issued as soon as their gradient exists:
    # a 2-rank flat ring with reduce_grads hid 1.8 s of its last hops by moving them and lost 1.1 s on its step)
    if node.op != "call_function" or not node.users or node.target in _COLLECTIVES:
        return False
    return not str(node.target).startswith("burstc.") and not _mutates_or_side_effects(node)


def deferrable_nodes(graph: fx.Graph) -> set[fx.Node]:
    """The nodes whose every reader is deferrable or the output (reverse order: readers first)."""
    deferrable: set[fx.Node] = set()
    for node in reversed(graph.nodes):
        if _movable(node) and all(user in deferrable or user.op == "output" for user in node.users):
            deferrable.add(node)
    return deferrable


def _nbytes(node: fx.Node) -> int:
    value = val(node)
    if isinstance(value, (tuple, list)):
        return sum(v.numel() * v.element_size() for v in value if isinstance(v, torch.Tensor))
    return value.numel() * value.element_size() if isinstance(value, torch.Tensor) else 0


@dataclasses.dataclass
class Split:
    """One ring backward and the nodes moved between its start and finish (graph order)."""

    ring: fx.Node
    moved: list[fx.Node]
    extended_bytes: int
    cap_bytes: int
    gradients_reduced: bool = False
    """A gradient computed before it (since the previous one) is all-reduced in the graph (stays: see _movable)."""


def _choose(pending: list[fx.Node], ring: fx.Node, cap: int, order: dict[fx.Node, int]) -> tuple[list, int]:
    """The nodes of ``pending`` to move past ``ring``, nearest first, while the bytes of the tensors whose life
    they extend past it (inputs whose every reader came before it) stay within ``cap``."""
    at = order[ring]
    moved: set[fx.Node] = set()
    extended: dict[fx.Node, int] = {}
    total = 0
    for node in reversed(pending):
        if any(user not in moved and user.op != "output" and order[user] < at for user in node.users):
            continue  # a reader stays before the ring: so does this node
        new = [x for x in node.all_input_nodes if x not in moved and x not in extended
               and all(order[user] < at for user in x.users)]
        delta = sum(_nbytes(x) for x in new) - extended.get(node, 0)
        if total + delta > cap:
            continue
        moved.add(node)
        total += delta
        extended.pop(node, None)
        extended.update((x, _nbytes(x)) for x in new)
    return sorted(moved, key=order.__getitem__), total


def _feeds_a_reduction(node: fx.Node) -> bool:
    return node.op == "call_function" and any(user.target == _FUNCOL.all_reduce.default for user in node.users)


def plan_overlap(graph: fx.Graph, cap_of: Callable[[fx.Node], int]) -> list[Split]:
    """Each ring backward of ``graph`` with the deferrable nodes before it (since the previous ring backward or
    mutating node) that move into its last hop within ``cap_of(ring)`` bytes of extended lifetimes."""
    target = ring_backward_target()
    deferrable = deferrable_nodes(graph)
    order = {node: i for i, node in enumerate(graph.nodes)}
    splits, pending, reduced = [], [], False
    for node in graph.nodes:
        if node in deferrable:
            pending.append(node)
        elif _mutates_or_side_effects(node):
            pending = []  # nothing moves past a write or a side effect
        elif node.op == "call_function" and node.target == target:
            cap = cap_of(node)
            moved, extended = _choose(pending, node, cap, order)
            splits.append(Split(node, moved, extended, cap, reduced))
            pending, reduced = [], False
        reduced = reduced or _feeds_a_reduction(node)
    return splits


def moved_order(graph: fx.Graph, splits: list[Split]) -> list[fx.Node]:
    """The graph's nodes in the order the split graph runs them (each ring backward standing for its start, its
    moved nodes right after it), for the memory model's replay of a graph the pass has not rewritten."""
    moved_after = {split.ring: split.moved for split in splits}
    moved = {node for split in splits for node in split.moved}
    order = []
    for node in graph.nodes:
        if node in moved:
            continue
        order.append(node)
        order.extend(moved_after.get(node, ()))
    return order


def overlap_cap(memory_bytes: int | None) -> Callable[[fx.Node], int]:
    """The option ``overlap_memory_bytes`` per ring backward: ``memory_bytes``, or (None) what the call holds
    through its hop anyway."""
    from burstc.memory import pending_backward_buffers

    def cap_of(ring: fx.Node) -> int:
        if memory_bytes is not None:
            return memory_bytes
        return pending_backward_buffers(val(ring.args[1]), val(ring.args[2]))

    return cap_of


def overlap_ring_backward(gm: fx.GraphModule, *, config, context) -> fx.GraphModule:
    graph = gm.graph
    splits = plan_overlap(graph, overlap_cap(config.overlap_memory_bytes))
    if not splits:
        context.note = "no ring attention backward in this graph"
        return gm
    created, ordered = [], {}
    for split in splits:
        node = split.ring
        if not split.moved and split.gradients_reduced:
            context.skip(KIND, node, "the weight gradients before it are all-reduced in the graph (reduce_grads): "
                         "moving them would delay their sums; with reduce_grads=False (FSDP or DDP reducing "
                         "outside) they move into its last hop", code=CODES.gradients_reduced)
            continue
        if not split.moved:
            context.skip(KIND, node, "no weight gradient computed between the previous ring backward and this one "
                         f"can run during its last hop within {split.cap_bytes} bytes of extended lifetimes",
                         code=CODES.nothing_to_overlap)
            continue
        q, k, v = node.args[1:4]
        with graph.inserting_before(node):
            start = graph.call_function(torch.ops.burstc.ring_attention_backward_start.default, node.args,
                                        dict(node.kwargs))
        anchor = start
        for moved_node in split.moved:  # in their order, between the start and the finish
            anchor.append(moved_node)
            anchor = moved_node
        moved_set = set(split.moved)
        # the order holds under a compiler that reorders for memory (Inductor hoists a matmul above the start to free
        # its inputs sooner): the finish reads the moved work's last values, and its first nodes wait for the start
        leaves = [n for n in split.moved if isinstance(val(n), torch.Tensor) and not moved_set.issuperset(n.users)]
        roots = [n for n in split.moved if not moved_set.intersection(n.all_input_nodes)]
        with graph.inserting_after(anchor):
            finish = graph.call_function(torch.ops.burstc.ring_attention_backward_finish.default,
                                         (start, q, k, v, leaves))
        if config.backend == "inductor":
            ordered.update({root: start for root in roots})
        start.meta.update({key: value for key, value in node.meta.items() if key != "val"})
        # the finish's inputs are not the op's: Inductor would constrain them to the op's recorded eager inputs
        finish.meta.update({key: value for key, value in node.meta.items() if key != "eager_input_vals"})
        node.replace_all_uses_with(finish)
        graph.erase_node(node)
        created.append(start)
        context.rewrite(KIND, finish, {"moved_nodes": len(split.moved), "extended_bytes": split.extended_bytes,
                                       "cap_bytes": split.cap_bytes})
    if not created:
        return gm
    graph.lint()
    propagate_meta(created, fake_mode_of(gm))
    if ordered:  # torch's own ordering edges (control_deps), as its overlap scheduler adds them
        from torch._inductor.fx_passes.control_dependencies import preserve_node_ordering
        from torch.utils._ordered_set import OrderedSet

        preserve_node_ordering(graph, {root: OrderedSet([start]) for root, start in ordered.items()})
        graph.lint()
    gm.recompile()
    context.rewrite(KIND, "graph", {"splits": len(created),
                                    "extended_bytes_max": max(s.extended_bytes for s in splits if s.moved)},
                    module="")
    return gm
