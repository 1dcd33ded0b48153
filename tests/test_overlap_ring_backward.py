"""The ``overlap_ring_backward`` pass: each ring backward split at its last hop, weight gradients moved into it.

Per rank, the same model compiled with the pass and without it (``disable_passes=["overlap_ring_backward"]``):
loss and gradients bit-identical (nothing is computed differently, only later), on both backward plans, a flat
and a double ring, aot_eager and Inductor; the graph holds one start and one finish per attention layer, every
node between them is a moved weight gradient (it cannot read the finish), at least one matmul among them, and
Inductor emits the kernels in that order; the ring counters see the time away (the last hop's transfer hidden by
the moved work, not counted in the call's own time).  These compile with ``reduce_grads=False`` (gradients
reduced outside the graph); with the default, the gradients' in-graph all-reduces keep them in place (each ring
backward reported, nothing split).  The memory bound holds and decides how much moves (0: nothing, with the
reason; a large one: more than the default), and the memory model replays the backward in the split graph's order.  A ring backward with nothing before it is left
whole, with its reason; a token finished twice is an error, not a silent reuse.
"""
from __future__ import annotations

import pytest
import torch

from burstc.testing import zoo

PASS = "overlap_ring_backward"


_step = zoo.compiled_titan_step


def _split_vs_whole(rank, world_size, mesh_shape, options):
    from torch.distributed.device_mesh import init_device_mesh

    from burstc.passes.overlap_ring_backward import deferrable_nodes

    names = ("inter", "intra") if len(mesh_shape) == 2 else None
    mesh = init_device_mesh("cpu", mesh_shape, mesh_dim_names=names)
    options = {"reduce_grads": False, **options}  # gradients reduced outside the graph: the weight gradients move
    loss, grads, report, stats = _step(mesh, **options)
    whole_loss, whole_grads, _, _ = _step(mesh, disable_passes=[PASS], **options)
    graph = report.graphs[PASS].graph
    nodes = list(graph.nodes)
    ops = torch.ops.burstc
    starts = [i for i, n in enumerate(nodes) if n.target == ops.ring_attention_backward_start.default]
    finishes = [i for i, n in enumerate(nodes) if n.target == ops.ring_attention_backward_finish.default]
    between = [nodes[s + 1:f] for s, f in zip(starts, finishes)]
    deferrable_before = {n.name for n in deferrable_nodes(report.graphs["backward"].graph)}

    def is_mm(node) -> bool:  # a matmul, or one Inductor's ordering edge wraps (control_deps)
        if node.target == torch.ops.aten.mm.default:
            return True
        sub = getattr(node.graph.owning_module, str(node.args[1].target), None) if "control_deps" in str(
            node.target) else None
        return sub is not None and any(n.target == torch.ops.aten.mm.default for n in sub.graph.nodes)
    record = next(r for r in report.graph_records if "backward" in r.schedules) if options.get(
        "backend") == "inductor" else None
    kernel_order = None
    if record is not None:  # Inductor's emitted order: each moved matmul's kernel between its start's and finish's
        schedule = record.schedules["backward"]
        kernel_order = all(schedule[nodes[s].name] < schedule[n.name] < schedule[nodes[f].name]
                           for s, f, moved in zip(starts, finishes, between) for n in moved
                           if n.target == torch.ops.aten.mm.default and n.name in schedule)
    # the memory model replays the graph before the pass in the order the pass gives it: the same order
    from burstc.memory import BackwardOverlap, _overlap_order

    before = report.graphs["backward"]
    names_before = {n.name for n in before.graph.nodes}
    replayed = [n.name for n in _overlap_order(before, BackwardOverlap(options.get("overlap_memory_bytes")))
                if n.target != ops.ring_attention_backward.default]
    backward_calls = [c for c in stats.calls if c.op == "backward"]
    return {
        "bitwise": bool(torch.equal(loss, whole_loss)) and sorted(grads) == sorted(whole_grads)
        and all(torch.equal(grads[k], whole_grads[k]) for k in grads),
        "whole_left": sum(n.target == ops.ring_attention_backward.default for n in nodes),
        "starts": len(starts), "finishes": len(finishes),
        "paired": all(s < f for s, f in zip(starts, finishes)) and all(
            nodes[f].args[0] is nodes[s] for s, f in zip(starts, finishes)),
        "only_moved_between": not any("burstc" in str(n.target) for moved in between for n in moved),
        # in the graph before the pass, every node moved into a hop fed only the outputs
        "moved_are_deferrable": all(n.name in deferrable_before for moved in between for n in moved
                                    if n.op != "get_attr"),
        "control_deps": sum("control_deps" in str(n.target) for n in nodes),
        "replay_order": replayed == [n.name for n in nodes if n.name in names_before],
        "matmuls_between": [sum(is_mm(n) for n in moved) for moved in between],
        "details": [r.details for r in report.rewrites_of(PASS) if r.node != "graph"],
        "graph_details": next(r.details for r in report.rewrites_of(PASS) if r.node == "graph"),
        "kernel_order": kernel_order,
        "away_s": [c.away_s for c in backward_calls],
        "hop_hidden_s": [c.hidden_s_per_step[-1] for c in backward_calls],
        "attentions": len(report.rewrites_of("attention")),
    }


def _check(results):
    for result in results:
        assert result["bitwise"]
        assert result["whole_left"] == 0 and result["starts"] == result["finishes"] > 0 and result["paired"]
        assert result["starts"] == result["attentions"]  # one split per attention layer
        assert result["only_moved_between"] and result["moved_are_deferrable"] and result["replay_order"]
        assert all(count >= 1 for count in result["matmuls_between"]), result["matmuls_between"]
        assert [d["moved_nodes"] > 0 for d in result["details"]] == [True] * result["starts"]
        assert all(d["extended_bytes"] <= d["cap_bytes"] for d in result["details"])  # the memory bound
        assert result["graph_details"]["splits"] == result["starts"]
        assert result["graph_details"]["extended_bytes_max"] == max(d["extended_bytes"] for d in result["details"])
        # every backward call left the thread for the moved work, and its last hop counted that time as hidden
        assert len(result["away_s"]) == result["starts"] and all(s > 0 for s in result["away_s"])
        assert all(s > 0 for s in result["hop_hidden_s"])


@pytest.mark.multirank
@pytest.mark.parametrize("plan", ["burst", "kv_ring"])
def test_split_backward_is_bit_identical_on_two_ranks(workers, plan):
    _check(workers.get(2).run(_split_vs_whole, (2,), {"attention_plan": plan}))


@pytest.mark.multirank
def test_split_backward_with_inductor_keeps_the_order(workers):
    results = workers.get(2).run(_split_vs_whole, (2,), {"backend": "inductor"})
    _check(results)
    # the order Inductor emitted (cold cache: a cached graph records none), held by torch's ordering edges
    assert all(result["kernel_order"] is True and result["control_deps"] > 0 for result in results)


@pytest.mark.multirank
def test_split_backward_on_a_double_ring(workers):
    _check(workers.get(4).run(_split_vs_whole, (2, 2), {"ring": "double"}))


def _moved_by_bound(rank, world_size):
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (world_size,))
    found = {}
    for bound, reduce_grads in ((None, False), (0, False), (2**30, False), (2**30, True)):
        _, _, report, _ = _step(mesh, overlap_memory_bytes=bound, reduce_grads=reduce_grads)
        found[bound, reduce_grads] = (
            [r.details for r in report.rewrites_of(PASS) if r.node != "graph"],
            [s.code for s in report.skipped if s.pass_name == PASS], len(report.rewrites_of("attention")),
            sum("ring_attention_backward_start" in str(n.target) for n in report.graphs[PASS].graph.nodes))
    return found


@pytest.mark.multirank
def test_the_memory_bound_decides_how_much_moves(workers):
    for found in workers.get(2).run(_moved_by_bound):
        (default, _, layers, _), (zero, zero_codes, _, zero_starts) = found[None, False], found[0, False]
        large, reduced, reduced_codes, _, reduced_starts = *found[2**30, False][:1], *found[2**30, True]
        assert zero == [] and zero_codes == ["overlap.nothing_to_overlap"] * layers and zero_starts == 0
        assert len(default) == len(large) == layers
        for d, big in zip(default, large):
            assert d["extended_bytes"] <= d["cap_bytes"] and big["extended_bytes"] <= 2**30
            assert big["moved_nodes"] > d["moved_nodes"] >= 1 and big["extended_bytes"] > d["cap_bytes"]
        # gradients all-reduced in the graph (the default) never move, whatever the bound: their sums go out first
        assert reduced == [] and reduced_codes == ["overlap.gradients_reduced"] * layers and reduced_starts == 0


class _AttentionOnTokens(torch.nn.Module):
    """One attention straight on the token embeddings: before its backward comes only the loss's gradient (which
    the ring reads); the embedding's gradient comes after it.  Nothing to move."""

    def __init__(self):
        super().__init__()
        self.embed = torch.nn.Embedding(32, 16)

    def forward(self, ids):
        x = self.embed(ids).view(ids.shape[0], ids.shape[1], 2, 8).transpose(1, 2)
        return torch.nn.functional.scaled_dot_product_attention(x, x, x, is_causal=True).square().sum()


def _nothing_to_overlap(rank, world_size):
    import burstc
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (world_size,))
    torch.manual_seed(1)
    cmodel = burstc.compile(_AttentionOnTokens(), mesh, backend="aot_eager", reduce_grads=False)
    cmodel(torch.randint(0, 32, (1, 64), generator=torch.Generator().manual_seed(2))).backward()
    report = burstc.report(cmodel)
    return {"codes": [s.code for s in report.skipped if s.pass_name == PASS],
            "rewrites": len(report.rewrites_of(PASS)),
            "attention": len(report.rewrites_of("attention"))}


@pytest.mark.multirank
def test_nothing_to_overlap_is_reported(workers):
    for result in workers.get(2).run(_nothing_to_overlap):
        assert result["attention"] == 1  # the ring ran: its backward had nothing before it to move
        assert result["codes"] == ["overlap.nothing_to_overlap"] and result["rewrites"] == 0


def test_a_token_finishes_once():
    from burstc.ops import ring_attention

    like = torch.zeros(1, 1, 2, 2)
    ring_attention._NEXT_TOKEN[0] += 1
    token = ring_attention._NEXT_TOKEN[0]
    ring_attention._PENDING_BACKWARDS[token] = lambda: (like + 1, like + 2, like + 3)
    dq, dk, dv = torch.ops.burstc.ring_attention_backward_finish(torch.tensor(token), like, like, like, [])
    assert (dq.sum(), dk.sum(), dv.sum()) == (4, 8, 12)
    with pytest.raises(RuntimeError, match="never started or is already finished"):
        torch.ops.burstc.ring_attention_backward_finish(torch.tensor(token), like, like, like, [])


def test_overlap_option_is_validated():
    from burstc.config import BurstConfig

    assert BurstConfig(overlap_memory_bytes=0).overlap_memory_bytes == 0
    for bad in (-1, 1.5, True, "1MB"):
        with pytest.raises(ValueError, match="overlap_memory_bytes"):
            BurstConfig(overlap_memory_bytes=bad)
