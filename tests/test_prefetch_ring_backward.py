"""The ``prefetch_ring_backward`` pass: each ring backward's first transfer posted from a node of its own, ahead of
the layer's other backward work.

Per rank, the same model compiled with the pass and without it (``disable_passes=["prefetch_ring_backward"]``):
loss and gradients bit-identical (the same transfers and arithmetic, posted earlier), the ring counters' bytes
per step identical, on both backward plans, a flat and a double ring, aot_eager and Inductor, with the backward
split by ``overlap_ring_backward`` or whole.  The graph holds one prefetch per attention layer, its token read by
that layer's ring backward alone, with the layer's MLP backward (matmuls) between them, and never two in flight:
each after the previous ring backward has finished.  The hybrid ring is reported, not prefetched; a token used
twice is an error.
"""
from __future__ import annotations

import operator

import pytest
import torch

from burstc.testing import zoo

PASS = "prefetch_ring_backward"


def _step(mesh, **options):
    loss, grads, report, stats = zoo.compiled_titan_step(mesh, **options)
    bytes_per_step = [(c.op, tuple(c.bytes_sent_per_step), tuple(c.bytes_received_per_step)) for c in stats.calls]
    return loss, grads, report, bytes_per_step


def _with_vs_without(rank, world_size, mesh_shape, options):
    from torch.distributed.device_mesh import init_device_mesh

    names = ("inter", "intra") if len(mesh_shape) == 2 else None
    mesh = init_device_mesh("cpu", mesh_shape, mesh_dim_names=names)
    loss, grads, report, sent = _step(mesh, **options)
    plain_loss, plain_grads, _, plain_sent = _step(mesh, disable_passes=[PASS], **options)
    ops = torch.ops.burstc
    rings = (ops.ring_attention_backward.default, ops.ring_attention_backward_start.default)
    nodes = list(report.graphs[PASS].graph.nodes)
    index = {n: i for i, n in enumerate(nodes)}
    prefetches = [n for n in nodes if n.target == ops.ring_attention_backward_prefetch.default]
    ring_nodes = [n for n in nodes if n.target in rings]
    # Inductor: torch's ordering edge (control_deps) reads the token too, holding the next node after the prefetch
    readers = [[u for u in p.users if "control_deps" not in str(u.target)] for p in prefetches]
    ordering = [sum("control_deps" in str(u.target) for u in p.users) for p in prefetches]
    ends = [next((u for u in r.users if u.target == ops.ring_attention_backward_finish.default), r) for r in ring_nodes]
    return {
        "bitwise": bool(torch.equal(loss, plain_loss)) and sorted(grads) == sorted(plain_grads)
        and all(torch.equal(grads[k], plain_grads[k]) for k in grads),
        "same_bytes": sent == plain_sent and len(sent) > 0,
        "prefetches": len(prefetches), "rings": len(ring_nodes),
        "attentions": len(report.rewrites_of("attention")),
        # each token read by exactly one ring backward, as its `prefetched`, placed before it
        "wired": all(len(users) == 1 and users[0] in ring_nodes and users[0].kwargs.get("prefetched") is p
                     and index[p] < index[users[0]] for p, users in zip(prefetches, readers)),
        # one in flight: prefetch i comes after ring backward i - 1 has finished
        "one_in_flight": all(index[ends[i - 1]] < index[p] for i, p in enumerate(prefetches) if i > 0),
        "matmuls_ahead": [sum(n.target == torch.ops.aten.mm.default for n in nodes[index[p] + 1:index[users[0]]])
                          for p, users in zip(prefetches, readers)],
        "details": [r.details for r in report.rewrites_of(PASS)],
        "ordering_edges": ordering,
    }


def _check(results):
    for result in results:
        assert result["bitwise"] and result["same_bytes"]
        assert result["prefetches"] == result["rings"] == result["attentions"] > 0
        assert result["wired"] and result["one_in_flight"], result
        assert all(count >= 1 for count in result["matmuls_ahead"]), result["matmuls_ahead"]
        assert [d["ahead_of_nodes"] > 0 for d in result["details"]] == [True] * result["prefetches"]


@pytest.mark.multirank
@pytest.mark.parametrize("plan", ["burst", "kv_ring"])
def test_prefetch_is_bit_identical_on_two_ranks(workers, plan):
    _check(workers.get(2).run(_with_vs_without, (2,), {"attention_plan": plan}))


@pytest.mark.multirank
def test_prefetch_ahead_of_a_split_backward_with_inductor(workers):
    # reduce_grads=False: overlap_ring_backward splits each backward; the prefetch follows the previous finish
    results = workers.get(2).run(_with_vs_without, (2,), {"backend": "inductor", "reduce_grads": False})
    _check(results)
    assert all(result["ordering_edges"] == [1] * result["prefetches"] for result in results)


@pytest.mark.multirank
@pytest.mark.parametrize("plan", ["burst", "kv_ring"])
def test_prefetch_on_a_double_ring(workers, plan):
    # the first lane's transfer, over the inter-node link
    _check(workers.get(4).run(_with_vs_without, (2, 2), {"ring": "double", "attention_plan": plan}))


def _graph_with_ring_backwards(between: int, group_names=("g",)):
    """A backward graph: placeholders, ``between`` matmuls, a ring backward reading them, then another matmul and
    a second ring backward; returns ``(graph module, ring nodes)``."""
    import burstc.ops.ring_attention  # noqa: F401  (registers the ops)

    graph = torch.fx.Graph()
    q, k, v, out, lse, w = (graph.placeholder(name) for name in ("q", "k", "v", "out", "lse", "w"))
    x = w
    for _ in range(between):
        x = graph.call_function(torch.ops.aten.mm.default, (x, w))
    grad_out = graph.call_function(torch.ops.aten.add.Tensor, (out, graph.call_function(torch.ops.aten.sum.default,
                                                                                        (x,))))
    config = (list(group_names), "zigzag", "causal", 0.125, "kv_ring")
    first = graph.call_function(torch.ops.burstc.ring_attention_backward.default,
                                (grad_out, q, k, v, out, lse, None, *config))
    dq = graph.call_function(operator.getitem, (first, 0))
    y = graph.call_function(torch.ops.aten.mm.default, (w, w))
    second = graph.call_function(torch.ops.burstc.ring_attention_backward.default,
                                 (graph.call_function(torch.ops.aten.add.Tensor, (dq, graph.call_function(
                                     torch.ops.aten.sum.default, (y,)))), q, k, v, out, lse, None, *config))
    graph.output((first, second))
    return torch.fx.GraphModule(torch.nn.Module(), graph), (first, second)


def _run_pass(gm, **options):
    from burstc.config import BurstConfig
    from burstc.pass_context import PassContext
    from burstc.passes.prefetch_ring_backward import prefetch_ring_backward
    from burstc.report import Report

    config = BurstConfig(backend="aot_eager", **options)
    context = PassContext(report=Report(config, world_size=2), graph_id=0, world_size=2)
    context.start_pass(PASS)
    return prefetch_ring_backward(gm, config=config, context=context), context.report


def test_each_ring_backward_prefetched_after_the_previous_one():
    gm, (first, second) = _graph_with_ring_backwards(between=2)
    gm, report = _run_pass(gm)
    nodes = list(gm.graph.nodes)
    prefetches = [n for n in nodes if n.target == torch.ops.burstc.ring_attention_backward_prefetch.default]
    assert [first.kwargs["prefetched"], second.kwargs["prefetched"]] == prefetches
    last_placeholder = max(i for i, n in enumerate(nodes) if n.op == "placeholder")
    # the first right after the placeholders (its inputs are saved tensors), the second right after the first ring
    assert nodes.index(prefetches[0]) == last_placeholder + 1
    assert nodes[nodes.index(prefetches[1]) - 1] is first
    assert [r.details["ahead_of_nodes"] for r in report.rewrites_of(PASS)] == [4, 4]  # mm, mm, sum, add; getitem, mm, sum, add
    assert prefetches[0].args[:4] == first.args[1:4] + (first.args[5],)  # q, k, v, lse


def test_nothing_between_and_the_hybrid_ring_are_skipped_with_their_codes():
    gm, _ = _graph_with_ring_backwards(between=0, group_names=("ulysses", "intra", "inter"))
    _, report = _run_pass(gm)
    assert [s.code for s in report.skipped] == ["prefetch.ulysses"] * 2 and not report.rewrites_of(PASS)
    # a ring backward right after its inputs: nothing to run ahead of it
    graph = torch.fx.Graph()
    q, k, v, out, lse, grad_out = (graph.placeholder(name) for name in ("q", "k", "v", "out", "lse", "grad_out"))
    ring = graph.call_function(torch.ops.burstc.ring_attention_backward.default,
                               (grad_out, q, k, v, out, lse, None, ["g"], "zigzag", "causal", 0.125, "burst"))
    graph.output(ring)
    _, report = _run_pass(torch.fx.GraphModule(torch.nn.Module(), graph))
    assert [s.code for s in report.skipped] == ["prefetch.nothing_to_overlap"] and not report.rewrites_of(PASS)


def test_a_prefetch_token_is_used_once():
    from burstc.ops import ring_attention

    ring_attention._NEXT_TOKEN[0] += 1
    token = ring_attention._NEXT_TOKEN[0]
    like = torch.zeros(1, 1, 2, 2)
    with pytest.raises(RuntimeError, match="never posted or is already used"):
        ring_attention._start_backward(like, like, like, like, like, like[..., 0], None, ["g"], "zigzag", "causal",
                                       0.5, "burst", None, None, 0, True, None, torch.tensor(token))


def test_the_option_turns_it_off_and_is_validated():
    from burstc.config import BurstConfig

    gm, _ = _graph_with_ring_backwards(between=2)
    gm, report = _run_pass(gm, prefetch_ring_backward=False)
    assert not report.skipped and not report.rewrites_of(PASS)
    assert not any(n.target == torch.ops.burstc.ring_attention_backward_prefetch.default for n in gm.graph.nodes)
    with pytest.raises(ValueError, match="prefetch_ring_backward"):
        BurstConfig(prefetch_ring_backward=None)


OP_CASES = [  # (ring, layout, mask, plan, forced head groups)
    ("flat", "zigzag", "causal", "burst", 4),
    ("flat", "striped", "documents&padding", "kv_ring", 2),  # batch groups: padding that differs between rows
    ("double", "zigzag", "causal", "kv_ring", 4),
    ("double", "contiguous", "documents&padding", "burst", 1),
]


def _op_task(rank, world_size, cases):
    """Per case: the backward op plain and after a prefetch of the same call (with a matmul between), this rank's
    (dq, dk, dv) and byte counters for each."""
    from torch.distributed.device_mesh import init_device_mesh

    from burstc import layout as layouts
    from burstc.attention_ir import Documents, KeyPadding, MaskSpec
    from burstc.ops import head_groups
    from burstc.ops import ring_attention as ra
    from burstc.testing.ring_cases import runtime_mask_data

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("inter", "intra"))
    results = []
    for index, (ring, layout, name, plan, groups) in enumerate(cases):
        group_names, _ = ra.resolve_ring_groups(mesh, ring)
        local_len = 6 if layout == "zigzag" else 5
        seq_len = local_len * world_size
        mask = MaskSpec.causal()
        if name == "documents&padding":
            mask = mask & Documents("doc_ids") & KeyPadding("attention_mask")
        data = runtime_mask_data(mask, 2, seq_len, index, doc_start_probability=0.2)
        generator = torch.Generator().manual_seed(200 + index)
        q, grad_out = (torch.randn(2, 8, seq_len, 8, generator=generator) for _ in range(2))
        k, v = (torch.randn(2, 4, seq_len, 8, generator=generator) for _ in range(2))
        q, k, v, grad_out = (layouts.shard(t, 2, world_size, rank, layout) for t in (q, k, v, grad_out))
        config = (group_names, layout, mask.encode(), 0.3, plan, data["doc_ids"], data["key_valid"])
        per_way = []
        with head_groups.head_groups_forced(groups):
            out, lse = torch.ops.burstc.ring_attention_forward(q, k, v, *config)
            for prefetch in (False, True):
                with ra.record_stats() as stats:
                    token = torch.ops.burstc.ring_attention_backward_prefetch(q, k, v, lse, *config) if prefetch \
                        else None
                    torch.randn(64, 64) @ torch.randn(64, 64)  # the work a prefetched transfer travels behind
                    grads = torch.ops.burstc.ring_attention_backward(grad_out, q, k, v, out, lse, None, *config,
                                                                     prefetched=token)
                per_way.append((grads, [(c.bytes_sent_per_step, c.bytes_received_per_step, c.work_per_step,
                                         c.head_groups, c.batch_groups) for c in stats.calls]))
        results.append(per_way)
    return results


@pytest.mark.multirank
def test_the_prefetched_op_gives_the_plain_ops_bits_and_bytes(workers):
    """Op level, beyond the model tests: head groups (only the first loop's first transfer is prefetched) and
    batch groups (padding rows that differ), runtime masks, a flat and a double ring, both plans."""
    for rank, results in enumerate(workers.get(4).run(_op_task, OP_CASES)):
        for case, ((plain, plain_counters), (ahead, ahead_counters)) in zip(OP_CASES, results):
            assert all(torch.equal(a, b) for a, b in zip(plain, ahead)), (rank, case)
            assert all(torch.isfinite(g).all() for g in plain), (rank, case)
            assert plain_counters == ahead_counters and len(plain_counters) == 1, (rank, case)
            assert plain_counters[0][3] == case[4] or case[2] != "causal", (rank, case)  # the forced head groups ran
