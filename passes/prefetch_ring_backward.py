"""Pass ``prefetch_ring_backward`` (stage aot_backward, mesh only): each ring backward's first transfer posted
from a node of its own, ahead of the layer's other backward work.

A ring backward's first transfer carries the travelling side of its first step: K and V (``kv_ring``), or Q,
dO, the LSE and delta (``burst``); on the double ring it is the first lane's, over the slow inter-node link.
Inside the op it goes out when the backward starts and is waited for after the first block: whatever of it the
first block does not hide is exposed.  But most of it exists long before: K, V, Q and the LSE are saved by the
forward.  Only dO and delta come from the layer's own backward (the output projection's).  So this pass
inserts ``burstc::ring_attention_backward_prefetch`` (posts the known-early tensors of the first transfer of the
call's first head and batch group, returns a token) and hands its token to the backward (``prefetched=``),
which posts the rest of that transfer when it starts.  Same bytes, same steps, same arithmetic: results are
bit-identical to the graph without it.

Where: right after the previous ring backward has finished (its finish node when ``overlap_ring_backward`` split
it, else the op), or, for the first ring backward of the graph, as soon as its inputs exist (the graph's start:
they are saved tensors).  So the transfer travels behind everything between: the MLP backward of the same
decoder layer, its norms, the output projection's backward (the fused loss's backward and the last layer's MLP
for the first one).  One prefetch is in flight at a time.  Memory: the prefetched rows' receive buffers (at
most one visiting shard of the known-early tensors, those the backward allocates for its first step anyway)
live from the prefetch instead of from the backward's start.

Measured under the emulated cluster (``README.md``): on 2 ranks at 11.3 MB/s with one head group the step is
6.5% faster (exposed waits 4.95 -> 3.37 s); on 2 x 2 with four ranks on two cores the exposed waits fall but the
step stays within noise (a waiting rank gives its core to another); with links not limited there is nothing to
hide.  ``prefetch_ring_backward=False`` turns it off (the pass notes it).

Skipped, with a code: a ring backward on the hybrid (Ulysses) ring, whose exchanges are all-to-alls inside its
own function (``prefetch.ulysses``), and one with no node between the earliest place and itself
(``prefetch.nothing_to_overlap``).
"""
from __future__ import annotations

import torch
import torch.fx as fx

from burstc.passes.graph_utils import fake_mode_of, normalized_kwargs, propagate_meta
from burstc.refusals import register_codes

KIND = "prefetch_ring_backward"
CODES = register_codes("prefetch", {
    "ulysses": "the hybrid (Ulysses) ring's exchanges are all-to-alls inside its own function: nothing to post ahead",
    "nothing_to_overlap": "no node runs between the earliest place its first transfer could be posted and the "
                          "ring backward itself",
})
# the arguments the prefetch takes, by name, in its schema's order
_PREFETCH_ARGS = ("q", "k", "v", "lse", "group_names", "layout", "mask", "scale", "plan", "doc_ids", "key_valid",
                  "uniform_rows_keys", "uniform_rows_score_grad", "chunk_owners")


def prefetch_inputs(args: dict) -> list[fx.Node]:
    """The nodes a ring backward's prefetch reads, of the ring backward's arguments by name (``normalized_kwargs``):
    the prefetch goes after the last of them (and after the previous ring backward), never after ``grad_out``."""
    return [args[name] for name in _PREFETCH_ARGS if isinstance(args.get(name), fx.Node)]


def _targets():
    import burstc.ops.ring_attention  # noqa: F401  (registers the ops)

    ops = torch.ops.burstc
    return (ops.ring_attention_backward.default, ops.ring_attention_backward_start.default,
            ops.ring_attention_backward_finish.default, ops.ring_attention_backward_prefetch.default)


def _end_of(node: fx.Node, finish_target) -> fx.Node:
    """The node after which a ring backward has finished: the finish reading a start's token, else itself."""
    finishes = [user for user in node.users if user.target == finish_target]
    return finishes[0] if finishes else node


def prefetch_ring_backward(gm: fx.GraphModule, *, config, context) -> fx.GraphModule:
    graph = gm.graph
    if not config.prefetch_ring_backward:
        context.note = "prefetch_ring_backward=False"
        return gm
    whole, start, finish, prefetch = _targets()
    rings = [node for node in graph.nodes if node.op == "call_function" and node.target in (whole, start)]
    if not rings:
        context.note = "no ring attention backward in this graph"
        return gm
    order = {node: i for i, node in enumerate(graph.nodes)}
    # placeholders come first: a prefetch goes after the last of them, never among them
    placeholders = [n for n in graph.nodes if n.op == "placeholder"]
    created, ordered, previous_end = [], {}, (placeholders[-1] if placeholders else None)
    for ring in rings:
        args = normalized_kwargs(ring)
        if args is None:  # (a burstc op always binds to its schema)
            raise AssertionError(f"{ring.format_node()} does not bind to its schema")
        inputs = prefetch_inputs(args)
        after = max(inputs + ([previous_end] if previous_end is not None else []), key=order.__getitem__)
        between = order[ring] - order[after] - 1
        if args.get("prefetched") is not None:
            pass  # a graph this pass already ran on: nothing to add
        elif list(args["group_names"])[:1] == ["ulysses"]:
            context.skip(KIND, ring, "the hybrid (Ulysses) ring trades its blocks by all-to-alls inside its own "
                         "function", code=CODES.ulysses)
        elif between <= 0:
            context.skip(KIND, ring, "nothing runs between its inputs (or the previous ring backward) and itself",
                         code=CODES.nothing_to_overlap)
        else:
            with graph.inserting_after(after):
                token = graph.call_function(prefetch, tuple(args[name] for name in _PREFETCH_ARGS))
            ring.kwargs = {**ring.kwargs, "prefetched": token}
            if config.backend == "inductor":  # Inductor reorders: the next node waits for the prefetch, as placed
                ordered[token.next] = token
            created.append(token)
            context.rewrite(KIND, token, {"ahead_of_nodes": between, "plan": args["plan"]})
        previous_end = _end_of(ring, finish)
    if not created:
        return gm
    graph.lint()
    propagate_meta(created, fake_mode_of(gm))
    if ordered:
        from torch._inductor.fx_passes.control_dependencies import preserve_node_ordering
        from torch.utils._ordered_set import OrderedSet

        preserve_node_ordering(graph, {node: OrderedSet([token]) for node, token in ordered.items()})
        graph.lint()
    gm.recompile()
    return gm
