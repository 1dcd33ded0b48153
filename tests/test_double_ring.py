"""The double ring (:mod:`burstc.ops.double_ring`) on 2-D gloo meshes: exact, and its bytes per link class.

Per mesh (2 x 2, 3 x 2 — three nodes, so a lane's gradients return before the last — and 2 x 4, slow),
mask kind (full, causal, windows, documents, padding, ALiBi), layout and backward plan: the op's output and
gradients against single-device SDPA, its byte counters (sent and received, per rank and step, and per
link class) against :func:`burstc.planner.predicted_double_ring_transfers`, and the inter-node bytes
against the flat ring's: each rank's rows cross to each other node at most once.
"""
from __future__ import annotations

import pytest
import torch

from burstc import layout as layouts
from burstc import planner
from burstc.attention_ir import Alibi, Documents, KeyPadding, MaskSpec, SlidingWindow
from burstc.ops import ring_attention as ra
from burstc.testing import balance, tolerance, zoo
from burstc.testing.ring_cases import ring_attention_case, runtime_mask_data

BATCH, HEADS_Q, HEADS_KV, HEAD_DIM = 2, 4, 2, 8
CAUSAL = MaskSpec.causal()
DOCS, PAD = Documents("doc_ids"), KeyPadding("attention_mask")
COMPARED = ("out", "dq", "dk", "dv")


def _masks(local_len: int) -> dict[str, MaskSpec]:
    return {
        "full": MaskSpec.full(),
        "causal": CAUSAL,
        "window_lt_shard": CAUSAL & SlidingWindow(max(0, local_len // 2 - 1)),
        "window_multi_shard": CAUSAL & SlidingWindow(2 * local_len + 1),
        "documents": CAUSAL & DOCS,
        "window&documents&padding": CAUSAL & SlidingWindow(local_len) & DOCS & PAD,
        # one slope per query head: the hybrid's ranks each hold a block of the heads (and only its slopes)
        "alibi": CAUSAL & Alibi(tuple(0.5 ** (head + 1) for head in range(HEADS_Q))),
    }


def _data_for(mask: MaskSpec, seq_len: int, seed: int) -> dict:
    return runtime_mask_data(mask, BATCH, seq_len, seed, doc_start_probability=0.2)


def _run_grid(rank, world_size, mesh_shape, grid):
    """Worker task: per case, (max error, reference scale) of out/dq/dk/dv vs fp32 SDPA, and the counters."""
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", mesh_shape, mesh_dim_names=("inter", "intra"))
    results = []
    for index, (layout, local_len, name, plan, ring) in enumerate(grid):
        seq_len = local_len * world_size
        mask = _masks(local_len)[name]
        errors, stats = ring_attention_case(rank, world_size, mask, layout, plan, seq_len,
                                            (BATCH, HEADS_Q, HEADS_KV, HEAD_DIM), _data_for(mask, seq_len, index),
                                            3000 + index, group_or_mesh=mesh, ring=ring)
        counters = {call.op: (call.plan, call.bytes_sent_per_step, call.bytes_received_per_step,
                              dict(call.bytes_sent_by_link)) for call in stats.calls}
        results.append((index, errors, counters))
    return results


def _grid(rings=("double",), layouts_=layouts.LAYOUTS, names=None):
    grid = []
    for layout in layouts_:
        local_len = 6 if layout == "zigzag" else 5
        for name in sorted(_masks(local_len)) if names is None else names:
            for plan in ra.PLANS:
                for ring in rings:
                    grid.append((layout, local_len, name, plan, ring))
    return grid


def _check(per_rank, mesh_shape, grid):
    nodes, per_node = mesh_shape
    world_size = nodes * per_node
    fp32 = (BATCH, HEADS_Q, HEADS_KV, HEAD_DIM, torch.float32)
    checked = 0
    for rank, results in enumerate(per_rank):
        for index, errors, counters in results:
            layout, local_len, name, plan, ring = grid[index]
            context = (mesh_shape, rank, layout, name, plan, ring)
            for key in COMPARED:
                allowed = tolerance(torch.float32, f"attention_{key}")
                diff, scale = errors[key]
                assert diff <= allowed.atol + allowed.rtol * scale, (context, key, diff, scale)
            mask, seq_len = _masks(local_len)[name], local_len * world_size
            data = _data_for(mask, seq_len, index)
            if ring == "ulysses":  # the ring runs across nodes, on node shards of H / G heads
                ring_len, ring_size, shape = local_len * per_node, nodes, (BATCH, HEADS_Q // per_node,
                                                                           HEADS_KV // per_node, HEAD_DIM, torch.float32)
            else:
                ring_len, ring_size, shape = local_len, world_size, fp32
            ring_rank = rank // per_node if ring == "ulysses" else rank  # the hybrid: its rank in its lane's ring
            # with the data: hidden pairs move nothing, packed documents only their trimmed blocks' rows, a padded
            # batch whose rows disagree sends per batch group
            if ring == "ulysses":
                def predict(batch, hidden, rows):
                    return planner.predicted_transfers(layout, mask.static_part, seq_len, nodes, batch, *shape[1:],
                                                       hidden_pairs=hidden, rows_between=rows)
            elif ring == "double":
                def predict(batch, hidden, rows):
                    return planner.predicted_double_ring_transfers(layout, mask.static_part, seq_len, nodes, per_node,
                                                                   batch, *fp32[1:], hidden_pairs=hidden,
                                                                   rows_between=rows)
            else:
                def predict(batch, hidden, rows):
                    return planner.predicted_transfers(layout, mask.static_part, seq_len, world_size, batch, *fp32[1:],
                                                       hidden_pairs=hidden, rows_between=rows)
            predicted = balance.data_transfers(predict, layout, mask, ring_len, ring_size, BATCH, data["doc_ids"],
                                               data["key_valid"])
            for op, key in (("forward", "forward"), ("backward", plan)):
                got_plan, sent, received, by_link = counters[op]
                assert list(sent) == list(predicted[key].sent_per_step[ring_rank]), (context, op)
                assert list(received) == list(predicted[key].received_per_step[ring_rank]), (context, op)
                if ring == "double":
                    want_links = predicted[key].sent_by_link[rank]
                    assert {k: v for k, v in by_link.items() if v} == {k: v for k, v in want_links.items() if v}, \
                        (context, op)
            checked += 1
    assert checked == world_size * len(grid)


@pytest.mark.multirank
def test_double_ring_2x2_is_exact_and_sends_what_the_planner_predicts(workers):
    """Every mask kind, layout and plan on the double ring and the hybrid; a few on the flat ring over the same
    2-D mesh."""
    grid = (_grid() + _grid(rings=("flat",), layouts_=("zigzag",), names=("causal", "documents"))
            + _grid(rings=("ulysses",), layouts_=("zigzag", "contiguous")))
    _check(workers.get(4).run(_run_grid, (2, 2), grid), (2, 2), grid)


@pytest.mark.multirank
def test_double_ring_3x2_returns_each_lane_home(workers):
    """Three nodes: lane 1's gradients go home in the middle of the backward, lane 2's at the end."""
    grid = _grid(names=("causal", "documents", "window_lt_shard"))
    _check(workers.get(6).run(_run_grid, (3, 2), grid), (3, 2), grid)


@pytest.mark.multirank
@pytest.mark.slow
def test_double_ring_2x4(workers):
    grid = _grid(layouts_=("zigzag", "contiguous"), names=("causal", "window&documents&padding"))
    _check(workers.get(8).run(_run_grid, (2, 4), grid), (2, 4), grid)


def _compiled_on_3d(rank, world_size, options):
    from burstc.testing import oracle
    return oracle.equivalence_task(rank, world_size, zoo.titan_llama, zoo.titan_inputs, zoo.call_with_loss,
                                   dict(backend="aot_eager", seq_dims=("inter", "intra"), **options),
                                   mesh_shape=(2, 2, 2), mesh_dim_names=("dp", "inter", "intra"))


# beside the other 8-rank test: the session's pool keeps at most 10 workers, so each switch between the 8-rank
# group and the 4-rank one restarts a group (~7 s to spawn, more for its first compile)
@pytest.mark.multirank
@pytest.mark.slow
def test_a_3d_mesh_shards_over_its_two_named_sequence_dims(workers):
    """("dp", "inter", "intra") with seq_dims=("inter", "intra"): each data-parallel replica a 2 x 2 double ring."""
    from burstc.testing.oracle import errors_above

    rtol = tolerance(torch.float32, "sharded_param_grad").rtol
    for result in workers.get(8).run(_compiled_on_3d, {}):
        assert not errors_above(result["errors"], rtol, rtol), result["report"]
        assert set(result["rings"]) == {"double 2x2"} and "sharded over 4 ranks" in result["report"]


@pytest.mark.parametrize("layout", layouts.LAYOUTS)
@pytest.mark.parametrize("mesh_shape", [(2, 2), (3, 2), (2, 4), (4, 4)])
def test_each_block_crosses_to_each_other_node_at_most_once(layout, mesh_shape):
    """Dense (full) attention: the double ring's inter-node bytes per rank and call are N - 1 blocks (the
    flat ring over the same ranks, in the direct pattern: one per remote rank, G (N - 1)); its intra-node
    bytes N (G - 1) blocks; causal masks send no more than that."""
    nodes, per_node = mesh_shape
    world_size, local_len = nodes * per_node, 6
    shape = (BATCH, HEADS_Q, HEADS_KV, HEAD_DIM, torch.float32)
    block = 2 * BATCH * HEADS_KV * local_len * HEAD_DIM * 4  # K and V of a shard, fp32
    for mask in (MaskSpec.full(), CAUSAL):
        double = planner.predicted_double_ring_transfers(layout, mask, local_len * world_size, nodes, per_node, *shape)
        flat = planner.predicted_transfers(layout, mask, local_len * world_size, world_size, *shape)
        for rank in range(world_size):
            links = double["forward"].sent_by_link[rank]
            assert links["inter"] <= (nodes - 1) * block and links["intra"] <= nodes * (per_node - 1) * block
            if mask == MaskSpec.full():
                assert links == {"inter": (nodes - 1) * block, "intra": nodes * (per_node - 1) * block}
                assert flat["forward"].sent[rank] == (world_size - 1) * block
            # every rank receives what it needs and the total matches the flat ring's (no row twice to a rank)
            assert sum(double["forward"].received_per_step[rank]) >= sum(flat["forward"].received_per_step[rank])


def _compiled_on_2x2(rank, world_size, options):
    from burstc.testing import oracle
    return oracle.equivalence_task(rank, world_size, zoo.titan_llama, zoo.titan_inputs, zoo.call_with_loss,
                                   dict(backend="aot_eager", **options), mesh_shape=(2, 2),
                                   mesh_dim_names=("inter", "intra"))


@pytest.mark.multirank
@pytest.mark.parametrize("ring", ["auto", "flat"])
def test_compile_on_a_2x2_mesh_matches_single_device(workers, ring):
    from burstc.testing.oracle import errors_above

    results = workers.get(4).run(_compiled_on_2x2, {"ring": ring})
    rtol = tolerance(torch.float32, "sharded_param_grad").rtol
    for result in results:
        assert ("shard", None) in result["rewrites"], result["report"]
        assert not errors_above(result["errors"], rtol, rtol), result["report"]
        want = "double 2x2" if ring == "auto" else "flat"
        assert result["rings"] and set(result["rings"]) == {want}, result["rings"]
        if ring == "auto":
            assert "double 2x2 ring" in result["report"]


def _compiled_on_dp_cp(rank, world_size, options):
    from burstc.testing import oracle
    return oracle.equivalence_task(rank, world_size, zoo.titan_llama, zoo.titan_inputs, zoo.call_with_loss,
                                   dict(backend="aot_eager", **options), mesh_shape=(2, 2),
                                   mesh_dim_names=("dp", "cp"))


@pytest.mark.multirank
def test_seq_dims_shards_over_the_named_dim_only(workers):
    """A ("dp", "cp") mesh with seq_dims=("cp",): each data-parallel replica runs its own 2-rank flat ring."""
    from burstc.testing.oracle import errors_above

    results = workers.get(4).run(_compiled_on_dp_cp, {"seq_dims": ("cp",)})
    rtol = tolerance(torch.float32, "sharded_param_grad").rtol
    for result in results:
        assert not errors_above(result["errors"], rtol, rtol), result["report"]
        assert set(result["rings"]) == {"flat"} and "sharded over 2 ranks" in result["report"], result["report"]


def _bad_mesh_options(rank, world_size, mesh_shape, names, options):
    import burstc
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", mesh_shape, mesh_dim_names=names)
    try:
        burstc.compile(torch.nn.Linear(2, 2), mesh, **options)
    except (ValueError, NotImplementedError) as error:
        return f"{type(error).__name__}: {error}"
    return "no error"


@pytest.mark.multirank
@pytest.mark.parametrize("shape,names,options,match", [
    ((2, 2), ("dp", "cp"), {"seq_dims": ("sp",)}, "does not have; its dims are"),
    ((4,), ("cp",), {"ring": "double"}, "two sequence dims of at least 2"),
    ((2, 2), ("dp", "cp"), {"seq_dims": ("cp",), "ring": "double"}, "two sequence dims of at least 2"),
])
def test_bad_mesh_options_raise_clear_errors(workers, shape, names, options, match):
    for answer in workers.get(4).run(_bad_mesh_options, shape, names, options):
        assert match in answer, answer


def test_seq_dims_and_ring_options_are_validated():
    from burstc.config import BurstConfig

    assert BurstConfig(seq_dims="cp").seq_dims == ("cp",)
    for bad in ((), ("a", "a"), (1,)):
        with pytest.raises(ValueError, match="seq_dims"):
            BurstConfig(seq_dims=bad)
    with pytest.raises(ValueError, match="ring"):
        BurstConfig(ring="triple")


@pytest.mark.multirank
def test_auto_picks_the_flat_ring_when_the_cost_model_says_so(workers):
    """Links inside a node 1000x slower than between nodes (the double ring's intra steps would dominate):
    the cost model picks the flat ring, and the report shows both predictions."""
    from burstc.testing.oracle import errors_above

    options = {"link_bandwidth": {"intra": 1e6, "inter": 1e9}}
    results = workers.get(4).run(_compiled_on_2x2, options)
    rtol = tolerance(torch.float32, "sharded_param_grad").rtol
    for result in results:
        assert not errors_above(result["errors"], rtol, rtol), result["report"]
        assert set(result["rings"]) == {"flat"}, result["rings"]
        assert "predicted_seconds" in result["report"]


@pytest.mark.multirank
@pytest.mark.parametrize("options,ring", [
    ({"ring": "ulysses"}, "ulysses_ring 2x2"),
    # intra-node links fast, inter-node ones slow: both two-level plans beat the flat ring
    ({"link_bandwidth": {"intra": 1e12, "inter": 1e6}}, ("double 2x2", "ulysses_ring 2x2")),
])
def test_compile_runs_the_hybrid_exactly(workers, options, ring):
    from burstc.testing.oracle import errors_above

    results = workers.get(4).run(_compiled_on_2x2, options)
    rtol = tolerance(torch.float32, "sharded_param_grad").rtol
    for result in results:
        assert not errors_above(result["errors"], rtol, rtol), result["report"]
        assert len(set(result["rings"])) == 1 and result["rings"][0] in ((ring,) if isinstance(ring, str) else ring)
