"""A selective checkpoint that keeps part of each attention's output (``checkpoint_keep=``): the ring forward over
each rank's first query rows (the recompute of the rows not kept) and the rewrite of the partitioned graphs.

The op: it returns rows ``[0, query_rows)``, equal to the full forward's, and the bytes it sends are the planner's
prediction (and fewer than a full forward's when the rows seen are fewer)."""
from __future__ import annotations

import pytest
import torch

from burstc import layout as layouts
from burstc.attention_ir import Documents, KeyPadding, MaskSpec, SlidingWindow
from burstc.block_geometry import blocks, clip_query_rows, first_rows_key_rows
from burstc.ops import ring_attention as ra
from burstc.planner import predicted_first_rows_forward, predicted_transfers

B, HQ, HKV, D = 2, 4, 2, 8


def _first_rows(rank, world_size, layout, mask_code, local_len, query_rows, seed, double_ring=False):
    gen = torch.Generator().manual_seed(seed)
    seq_len = local_len * world_size
    q, k, v = (torch.randn(B, h, seq_len, D, generator=gen) for h in (HQ, HKV, HKV))
    mask = MaskSpec.decode(mask_code)
    doc_ids = key_valid = None
    if mask.term(Documents) is not None:
        doc_ids = torch.cat([torch.full((seq_len // 3,), 0), torch.full((seq_len - seq_len // 3,), 1)]).repeat(B, 1)
    if mask.term(KeyPadding) is not None:  # left padding: the first rows' keys are mostly padding (fuzz seed 282 #25)
        key_valid = torch.arange(seq_len).repeat(B, 1) >= (seq_len * 5) // 9
    shard = lambda t: layouts.shard(t, 2, world_size, rank, layout)  # noqa: E731
    group = None
    if double_ring:  # 2 nodes x 2 ranks: the double ring's lanes relay the first rows' keys too
        from torch.distributed.device_mesh import init_device_mesh

        group = init_device_mesh("cpu", (2, world_size // 2))
    args = ([ra.resolve_ring_groups(group)[0], layout, mask.encode(), D ** -0.5, "kv_ring", doc_ids, key_valid, 0,
             True, None])
    with torch.no_grad():
        out, lse = torch.ops.burstc.ring_attention_forward(shard(q), shard(k), shard(v), *args)
        with ra.record_stats() as stats:
            part_out, part_lse = torch.ops.burstc.ring_attention_forward(shard(q), shard(k), shard(v), *args,
                                                                         query_rows)
    call = stats.calls[-1]
    def max_diff(got, want):  # rows that see no key: lse -inf in both, equal
        return float(torch.where(got == want, 0.0, (got - want).abs()).amax()) if got.numel() else 0.0

    return {"out": max_diff(part_out, out[:, :, :query_rows]), "lse": max_diff(part_lse, lse[:, :, :query_rows]),
            "shapes": (tuple(part_out.shape), tuple(part_lse.shape)),
            "finite": bool(part_out.isfinite().all()),
            "received": call.bytes_received_per_step, "sent": call.bytes_sent_per_step}


@pytest.mark.multirank
@pytest.mark.parametrize("world_size,layout,mask_code,local_len,query_rows", [
    (2, "zigzag", "causal", 8, 4),
    (3, "zigzag", "causal", 6, 3),
    (3, "zigzag", "causal", 6, 5),
    (4, "contiguous", "causal", 5, 2),
    (3, "striped", "causal", 7, 3),
    (3, "zigzag", "causal&window(4,-)", 8, 5),
    (2, "zigzag", "full", 6, 1),
    (3, "zigzag", "causal&document_ids(doc)", 6, 3),
    (3, "striped", "causal&key_padding(mask)", 3, 1),
    (4, "zigzag", "causal&key_padding(mask)", 4, 2),
])
def test_first_rows_forward_matches_and_sends_the_predicted_bytes(workers, world_size, layout, mask_code, local_len,
                                                                   query_rows):
    results = workers.get(world_size).run(_first_rows, layout, mask_code, local_len, query_rows, 7)
    mask = MaskSpec.decode(mask_code)
    predicted = predicted_first_rows_forward(layout, mask, query_rows, local_len * world_size, world_size, B, HQ, HKV,
                                             D, torch.float32)
    full = predicted_transfers(layout, mask.static_part, local_len * world_size, world_size, B, HQ, HKV, D,
                               torch.float32)["forward"]
    for rank, r in enumerate(results):
        assert r["out"] < 1e-5 and r["lse"] < 1e-5, (rank, r)
        assert r["shapes"] == ((B, HQ, query_rows, D), (B, HQ, query_rows)) and r["finite"], (rank, r)
        if mask.runtime_terms:  # the data can hide a pair the static prediction sends (an upper bound)
            assert sum(r["received"]) <= sum(predicted.received_per_step[rank]), rank
        else:
            assert list(r["received"]) == list(predicted.received_per_step[rank]), rank
            assert list(r["sent"]) == list(predicted.sent_per_step[rank]), rank
    if layout == "zigzag" and mask_code == "causal" and query_rows == local_len // 2:
        # rank r's early half sees only the r earlier ranks' early halves, where the full forward receives those and
        # the P - 1 - r later ranks' whole shards: a third of the bytes, on any P
        assert 0 < 3 * sum(predicted.received) == sum(full.received)


@pytest.mark.multirank
@pytest.mark.parametrize("mask_code", ["causal", "causal&window(5,-)"])
def test_first_rows_forward_on_a_double_ring(workers, mask_code):
    for rank, r in enumerate(workers.get(4).run(_first_rows, "zigzag", mask_code, 6, 2, 3, True)):
        assert r["out"] < 1e-5 and r["lse"] < 1e-5 and r["finite"], (rank, r)
        assert r["shapes"] == ((B, HQ, 2, D), (B, HQ, 2)), (rank, r)


@pytest.mark.parametrize("layout", ["zigzag", "contiguous", "striped"])
@pytest.mark.parametrize("mask", [MaskSpec.causal(), MaskSpec.causal() & SlidingWindow(5), MaskSpec.full()])
def test_clipped_blocks_cover_exactly_the_first_rows_visible_entries(layout, mask):
    world_size, local_len = 3, 8
    seq_len = world_size * local_len
    for query_rows in range(local_len + 1):
        for q_owner in range(world_size):
            for kv_owner in range(world_size):
                q_pos = layouts.local_positions(seq_len, world_size, q_owner, layout)
                kv_pos = layouts.local_positions(seq_len, world_size, kv_owner, layout)
                found = clip_query_rows(blocks(layout, mask, q_owner, kv_owner, local_len, world_size), query_rows,
                                        lambda: (q_pos, kv_pos, mask))
                covered = torch.zeros(local_len, local_len, dtype=torch.int64)
                for b in found:
                    assert b.q_stop <= query_rows
                    covered[b.q_rows, b.kv_rows] += 1
                visible = mask.visible(q_pos, kv_pos)
                visible[query_rows:] = False
                # every visible entry of the first rows in exactly one block; counts as the blocks say
                assert bool((covered[visible] == 1).all()) and int(covered.max()) <= 1
                assert sum(b.score_entries for b in found) == int(visible.sum())
                if mask.term(SlidingWindow) is None:  # closed-form blocks: exactly the keys the first rows see travel
                    travelling = first_rows_key_rows(layout, mask, query_rows, q_owner, kv_owner, local_len,
                                                     world_size)
                    assert travelling == _runs(visible.any(0)), (query_rows, q_owner, kv_owner, travelling)


def _runs(flags):
    runs, start = [], None
    for i, flag in enumerate(flags.tolist() + [False]):
        if flag and start is None:
            start = i
        elif not flag and start is not None:
            runs.append((start, i))
            start = None
    return tuple(runs)


# -- the graphs: checkpoint="selective" with checkpoint_keep < 1 ---------------------------------------------------


def _kept_rows_facts(rank, world_size, keep, model_fn, inputs_fn, loss_fn):
    """One training step under ``checkpoint="selective", checkpoint_keep=keep``: what the report says was kept, the
    ring calls of the backward graph, the bytes its recompute received, and the forward's saved outputs."""
    import burstc
    from torch.distributed.device_mesh import init_device_mesh

    torch._dynamo.reset()
    options = {"checkpoint": "selective"} | ({"checkpoint_keep": keep} if keep < 1 else {})
    cmodel = burstc.compile(model_fn(), init_device_mesh("cpu", (world_size,)), backend="aot_eager", **options)
    loss_fn(cmodel, inputs_fn()).backward()  # compiles
    with ra.record_stats() as stats:
        loss_fn(cmodel, inputs_fn()).backward()
    report = burstc.report(cmodel)
    backward = report.graphs["backward"]
    rings = [n for n in backward.graph.nodes if n.target is torch.ops.burstc.ring_attention_forward.default]
    recompute = [c for c in stats.calls if c.op == "forward"][len(rings) and -len(rings):] if rings else []
    return {"kept": [(k.local_rows, k.kept_rows, k.kept_bytes, k.recompute_bytes_received)
                     for _, k in report.kept_rows],
            "query_rows": [n.kwargs.get("query_rows") for n in rings],
            "recompute_received": [sum(c.bytes_received_per_step) for c in recompute],
            "forward_outputs": len(list(report.graphs["forward"].graph.output_node().args[0])),
            "text": str(report)}


@pytest.mark.multirank
@pytest.mark.parametrize("world_size", [2, 3])
def test_keeping_half_recomputes_the_early_rows_with_the_predicted_bytes(workers, world_size):
    from burstc.testing import zoo

    results = workers.get(world_size).run(_kept_rows_facts, 0.5, zoo.titan_llama, zoo.titan_inputs,
                                          zoo.call_with_loss)
    whole = workers.get(world_size).run(_kept_rows_facts, 1.0, zoo.titan_llama, zoo.titan_inputs, zoo.call_with_loss)
    for rank, (half, full) in enumerate(zip(results, whole)):
        assert full["kept"] == [] and full["query_rows"] == [] and full["recompute_received"] == []
        assert len(half["kept"]) == 2, half["kept"]  # the two layers' attentions
        (local_rows, kept_rows, kept_bytes, predicted), _ = half["kept"]
        assert kept_rows == round(local_rows / 2) and half["query_rows"] == [local_rows - kept_rows] * 2
        # the forward saves the kept rows' copies instead of the whole O and LSE: same count of saved values
        assert half["forward_outputs"] == full["forward_outputs"]
        assert "checkpoint_keep: 2 attention(s) keep the last" in half["text"]
        # the recompute moves what the planner predicts for the busiest rank, and the busiest rank is the last
        if rank == world_size - 1:
            assert half["recompute_received"] == [predicted, predicted], (half["recompute_received"], predicted)


@pytest.mark.multirank
@pytest.mark.parametrize("keep", [0.5, 0.25])
def test_keeping_part_matches_single_device(workers, keep):
    from burstc.testing import assert_equivalent, zoo

    results = assert_equivalent(zoo.titan_llama, zoo.titan_inputs, zoo.call_with_loss, world_size=2,
                                group=workers.get(2), backend="aot_eager", checkpoint="selective",
                                checkpoint_keep=keep)
    kinds = [k for k, _ in results[0]["rewrites"]]
    assert kinds.count("checkpoint_layers") == 2, kinds


@pytest.mark.multirank
def test_keeping_part_of_a_models_own_checkpointed_layers(workers):
    """HF Llama with gradient checkpointing on: the model's own regions become selective and keep half their rows."""
    pytest.importorskip("transformers")
    from burstc.testing import assert_equivalent, zoo

    results = assert_equivalent(zoo.hf_llama_checkpointed, zoo.hf_inputs, zoo.hf_loss_default, world_size=2,
                                group=workers.get(2), backend="aot_eager", checkpoint="selective",
                                checkpoint_keep=0.5)
    kinds = [k for k, _ in results[0]["rewrites"]]
    assert kinds.count("checkpoint_region") == 2 and kinds.count("checkpoint_layers") == 0, kinds


@pytest.mark.slow
@pytest.mark.multirank
def test_keeping_part_under_inductor(workers):
    from burstc.testing import assert_equivalent, zoo

    assert_equivalent(zoo.titan_llama, zoo.titan_inputs, zoo.call_with_loss, world_size=2, group=workers.get(2),
                      backend="inductor", checkpoint="selective", checkpoint_keep=0.5)


def test_checkpoint_keep_is_validated():
    from burstc.config import BurstConfig

    for bad in (0, 0.0, 1.5, -0.1, True, "half"):
        with pytest.raises(ValueError, match="checkpoint_keep"):
            BurstConfig(checkpoint="selective", checkpoint_keep=bad)
    with pytest.raises(ValueError, match="applies to checkpoint='selective'"):
        BurstConfig(checkpoint="layers", checkpoint_keep=0.5)
    assert BurstConfig(checkpoint="selective", checkpoint_keep=0.5).checkpoint_keep == 0.5
