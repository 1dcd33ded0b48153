"""Pass ``schedule`` (stage aot_backward, mesh only): parameter-gradient all-reduces bucketed, issued early, waited late.

On a mesh every replicated parameter's gradient is summed over the sequence ranks (``reduce_grads=True``,
``burstc.ops.sequence.grad_all_reduce``); AOTAutograd leaves each as ``all_reduce`` immediately followed by its
``wait_tensor``, so the backward stops at every parameter until its sum is back.  This pass groups those
all-reduces, in the order their gradients are produced, into buckets of at most ``config.grad_bucket_bytes``
(DDP's 25 MiB by default; one gradient larger than that is a bucket alone), and rewrites each bucket as::

    flat = cat([g.flatten() for g in bucket])      # right after the bucket's last gradient exists
    flat = all_reduce(flat, "sum", group)          # asynchronous (functional collective)
    ...                                            # the rest of the backward runs meanwhile
    flat = wait_tensor(flat)                       # just before the first use of any of its sums
    g_i = flat[offset_i : offset_i + n_i].view(shape_i)

``grad_bucket_bytes=0`` keeps one all-reduce per gradient and only moves the waits.  Memory: the flat sums
replace the gradients as the graph's outputs, so in flight a bucket costs its flat copy while the gradients it
was cut from are alive (they die at the cat unless something else reads them): peak memory rises by at most
one bucket.  Numerics: each element is summed over the same ranks; gloo's and NCCL's reductions add in an order
that may depend on an element's place in the buffer, so results are bit-identical on 2 ranks and within
rounding on more.

Other all-reduces (the loss, anything a user's code does) are left alone.
"""
from __future__ import annotations

import math

import torch
import torch.fx as fx

from burstc.passes.graph_utils import fake_mode_of, propagate_meta, val

_FUNCOL = torch.ops._c10d_functional
KIND = "schedule"


def _gradient_reductions(graph: fx.Graph) -> list[tuple[fx.Node, list[fx.Node]]]:
    """``(all_reduce, its waits)``: a sum all-reduce waited by a chain of ``wait_tensor`` (AOTAutograd may wait an
    already waited value again) whose last link only the graph's output reads (a parameter gradient)."""
    found = []
    for node in graph.nodes:
        if node.op != "call_function" or node.target != _FUNCOL.all_reduce.default or node.args[1] != "sum":
            continue
        waits, current = [], node
        while len(current.users) == 1:
            (user,) = current.users
            if user.op != "call_function" or user.target != _FUNCOL.wait_tensor.default:
                break
            waits.append(user)
            current = user
        if waits and current.users and all(user.op == "output" for user in current.users):
            found.append((node, waits))
    return found


def _nbytes(node: fx.Node) -> int:
    value = val(node)
    return value.numel() * value.element_size() if isinstance(value, torch.Tensor) else 0


def _buckets(pairs, cap: int) -> list[list[tuple[fx.Node, list[fx.Node]]]]:
    """Consecutive pairs of one group, dtype and device, at most ``cap`` bytes each (0: one pair per bucket)."""
    buckets, size, last_key = [], 0, None
    for pair in pairs:
        grad = pair[0].args[0]
        key = (pair[0].args[2], val(grad).dtype, val(grad).device)
        nbytes = _nbytes(grad)
        if not buckets or cap == 0 or size + nbytes > cap or key != last_key:
            buckets.append([pair])
            size = nbytes
        else:
            buckets[-1].append(pair)
            size += nbytes
        last_key = key
    return buckets


def schedule(gm: fx.GraphModule, *, config, context) -> fx.GraphModule:
    graph = gm.graph
    pairs = _gradient_reductions(graph)
    if not pairs:
        context.note = "no gradient all-reduces in this graph"
        return gm
    order = {node: i for i, node in enumerate(graph.nodes)}
    created: set[fx.Node] = set()
    total = sum(_nbytes(r.args[0]) for r, _ in pairs)
    buckets = _buckets(pairs, config.grad_bucket_bytes)
    for bucket in buckets:
        grads = [reduce_node.args[0] for reduce_node, _ in bucket]
        group = bucket[0][0].args[2]
        last_input = max(grads, key=order.__getitem__)
        first_use = min((user for _, waits in bucket for user in waits[-1].users), key=order.__getitem__)
        anchor = last_input

        def add(target, args):  # a new node after the last one added (inserting_after alone would reverse them)
            nonlocal anchor
            with graph.inserting_after(anchor):
                anchor = graph.call_function(target, args)
            created.add(anchor)
            return anchor

        flat = grads[0]
        if len(bucket) > 1:
            pieces = [add(torch.ops.aten.view.default, (g, [-1])) for g in grads]
            flat = add(torch.ops.aten.cat.default, (pieces,))
        reduced = add(_FUNCOL.all_reduce.default, (flat, "sum", group))
        with graph.inserting_before(first_use):
            waited = graph.call_function(_FUNCOL.wait_tensor.default, (reduced,))
            created.add(waited)
            offset = 0
            for (reduce_node, waits), grad in zip(bucket, grads):
                if len(bucket) == 1:
                    replacement = waited
                else:
                    numel = math.prod(val(grad).shape)
                    piece = graph.call_function(torch.ops.aten.slice.Tensor, (waited, 0, offset, offset + numel))
                    replacement = graph.call_function(torch.ops.aten.view.default, (piece, list(val(grad).shape)))
                    created.update((piece, replacement))
                    offset += numel
                waits[-1].replace_all_uses_with(replacement)
        for reduce_node, waits in bucket:
            for wait in reversed(waits):
                graph.erase_node(wait)
            graph.erase_node(reduce_node)
    graph.lint()
    # the new nodes' example values (Inductor and the later passes read them); the old nodes' are unchanged
    propagate_meta([node for node in graph.nodes if node in created], fake_mode_of(gm))
    gm.recompile()
    context.rewrite(KIND, "graph", {
        "gradient_all_reduces": len(pairs), "buckets": len(buckets), "bucket_cap_bytes": config.grad_bucket_bytes,
        "gradient_bytes": total,
    }, module="")
    return gm
