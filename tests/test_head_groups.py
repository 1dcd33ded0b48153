"""Ring calls as a pipeline of head groups (:mod:`burstc.ops.head_groups`): the policy, the pipeline's order,
and on gloo ranks the same results (to the last bit's rounding) and the same bytes as one group, on the flat ring, the double ring and the
hybrid, both backward plans, static and runtime masks."""
from __future__ import annotations

import pytest
import torch

from burstc.attention_ir import Alibi, Documents, KeyPadding, MaskSpec, SlidingWindow
from burstc.ops import head_groups
from burstc.ops.batch_groups import batch_row_groups
from burstc.ops.head_groups import MIN_GROUP_BYTES, head_group_count, head_slices, run_pipelined
from burstc.ops.ring_loops import MaskData
from burstc.testing import tolerance

BATCH, HEADS_Q, HEADS_KV, HEAD_DIM = 2, 8, 4, 8


def test_automatic_count_needs_a_large_step_and_divides_the_kv_heads():
    with head_groups.head_groups_forced(None):
        assert head_group_count(4, 16 * MIN_GROUP_BYTES, 4, False) == 4
        assert head_group_count(4, 3 * MIN_GROUP_BYTES, 4, False) == 2  # 3 groups would not divide 4 heads
        assert head_group_count(8, 64 * MIN_GROUP_BYTES, 4, False) == head_groups.MAX_HEAD_GROUPS
        assert head_group_count(4, MIN_GROUP_BYTES - 1, 4, False) == 1  # a small step is not split
        assert head_group_count(6, 16 * MIN_GROUP_BYTES, 2, False) == 3
        assert head_group_count(1, 16 * MIN_GROUP_BYTES, 4, False) == 1  # one K/V head: nothing to split
        assert head_group_count(4, 16 * MIN_GROUP_BYTES, 1, False) == 1  # one rank: nothing travels
        assert head_group_count(4, 16 * MIN_GROUP_BYTES, 4, True) == 1  # score mods index the heads


def test_forced_count_is_the_largest_divisor_at_most_the_request(monkeypatch):
    with head_groups.head_groups_forced(3):
        assert head_group_count(4, 0, 2, False) == 2
        assert head_group_count(6, 0, 2, False) == 3
    monkeypatch.setenv("BURSTC_RING_HEAD_GROUPS", "4")
    assert head_group_count(8, 0, 2, False) == 4
    monkeypatch.setenv("BURSTC_RING_HEAD_GROUPS", "0")
    with pytest.raises(ValueError, match="BURSTC_RING_HEAD_GROUPS"):
        head_group_count(8, 0, 2, False)
    with pytest.raises(ValueError):
        head_groups.set_head_groups(0)


def test_slices_keep_each_kv_head_with_the_query_heads_that_read_it():
    slices = head_slices(8, 2, 2)
    assert slices == [(slice(0, 4), slice(0, 1)), (slice(4, 8), slice(1, 2))]
    for q_heads, kv_heads in slices:  # SDPA's enable_gqa: query head h reads K/V head h // (Hq / Hkv)
        assert {h // 4 for h in range(q_heads.start, q_heads.stop)} == set(range(kv_heads.start, kv_heads.stop))


def test_pipeline_posts_ahead_and_waits_behind():
    events = []

    def loop(group):
        events.append(("first transfer", group))
        yield
        events.append(("body", group))
        yield
        events.append(("last hop waited", group))
        return (torch.full((1, 1), float(group)),)

    output = torch.zeros(1, 3)
    result = run_pipelined([loop(g) for g in range(3)], (output,), [(slice(g, g + 1),) for g in range(3)])
    assert events == [("first transfer", 0), ("first transfer", 1), ("body", 0), ("first transfer", 2),
                      ("body", 1), ("last hop waited", 0), ("body", 2), ("last hop waited", 1),
                      ("last hop waited", 2)]
    assert result[0] is output and output.tolist() == [[0.0, 1.0, 2.0]]

    events.clear()
    single = run_pipelined([loop(7)], None, [(slice(None),)])
    assert events == [("first transfer", 7), ("body", 7), ("last hop waited", 7)]
    assert single[0].item() == 7.0


def test_a_loop_of_other_than_three_parts_is_an_error():
    def short():
        yield
        return (torch.zeros(1, 1),)

    def long():
        for _ in range(3):
            yield
        return (torch.zeros(1, 1),)

    with pytest.raises(AssertionError, match="ended after 2 of its three parts"):
        run_pipelined([short(), short()], (torch.zeros(1, 2),), [(slice(0, 1),), (slice(1, 2),)])
    with pytest.raises(AssertionError, match="did not end after its three parts"):
        run_pipelined([long()], None, [(slice(None),)])


CASES = [  # (ring, layout, mask name, plan)
    ("flat", "zigzag", "causal", "burst"),
    ("flat", "striped", "documents&padding", "kv_ring"),
    ("flat", "contiguous", "window", "burst"),
    ("double", "zigzag", "causal", "burst"),
    ("double", "zigzag", "causal", "kv_ring"),
    ("double", "contiguous", "documents&padding", "burst"),
    ("ulysses", "zigzag", "causal", "burst"),
    ("ulysses", "zigzag", "documents&padding", "kv_ring"),
    ("flat", "zigzag", "alibi", "kv_ring"),  # score mods index the heads: one group
]


def _mask(name: str, local_len: int) -> MaskSpec:
    causal = MaskSpec.causal()
    return {"causal": causal, "window": causal & SlidingWindow(local_len // 2),
            "alibi": causal & Alibi(tuple(0.5 ** (h + 1) for h in range(HEADS_Q))),
            "documents&padding": causal & Documents("doc_ids") & KeyPadding("attention_mask")}[name]


def _groups_task(rank, world_size, cases):
    """Per case and forced group count (1, 4): this rank's out and grads, the byte and work counters, and the
    group counts the calls ran with."""
    from torch.distributed.device_mesh import init_device_mesh

    from burstc import layout as layouts
    from burstc.ops import ring_attention as ra
    from burstc.ops import ring_loops
    from burstc.testing.ring_cases import runtime_mask_data

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("inter", "intra"))
    seen = []
    original, original_start = ring_loops.run_pipelined, ring_loops.start_pipelined

    def counting(loops, *args):  # the forward runs its loops whole, the backward starts them (its finish waits)
        seen.append(len(loops))
        return original(loops, *args)

    def counting_start(loops, *args):
        seen.append(len(loops))
        return original_start(loops, *args)

    ring_loops.run_pipelined, ring_loops.start_pipelined = counting, counting_start
    results = []
    try:
        for index, (ring, layout, name, plan) in enumerate(cases):
            local_len = 6 if layout == "zigzag" else 5
            seq_len = local_len * world_size
            mask = _mask(name, local_len)
            data = runtime_mask_data(mask, BATCH, seq_len, index, doc_start_probability=0.2)
            generator = torch.Generator().manual_seed(100 + index)
            q, grad_out = (torch.randn(BATCH, HEADS_Q, seq_len, HEAD_DIM, generator=generator) for _ in range(2))
            k, v = (torch.randn(BATCH, HEADS_KV, seq_len, HEAD_DIM, generator=generator) for _ in range(2))
            shard = lambda t: layouts.shard(t, 2, world_size, rank, layout)  # noqa: E731
            per_count = {}
            for groups in (1, 4):
                seen.clear()
                leaves = [shard(t).requires_grad_() for t in (q, k, v)]
                with head_groups.head_groups_forced(groups), ra.record_stats() as stats:
                    out = ra.ring_attention(*leaves, mask=mask, layout=layout, plan=plan, scale=0.3,
                                            group_or_mesh=mesh, ring=ring, **data)
                    (out * shard(grad_out)).sum().backward()
                counters = [(c.op, c.bytes_sent_per_step, c.bytes_received_per_step, c.work_per_step,
                             dict(c.bytes_sent_by_link)) for c in stats.calls]
                summed = {}  # RingStats.bytes_sent_by_link: every call's, per link class
                for c in stats.calls:
                    for link, nbytes in c.bytes_sent_by_link.items():
                        summed[link] = summed.get(link, 0) + nbytes
                assert stats.bytes_sent_by_link == summed and sum(summed.values()) > 0, (stats.bytes_sent_by_link,
                                                                                        summed)
                per_count[groups] = ([out.detach()] + [t.grad for t in leaves], counters, list(seen),
                                     _batch_groups(data, BATCH))
            results.append(per_count)
    finally:
        ring_loops.run_pipelined, ring_loops.start_pipelined = original, original_start
    return results


def _batch_groups(data: dict, batch: int) -> int:
    """How many batch groups the call's padding makes (:mod:`burstc.ops.batch_groups`)."""
    return len(batch_row_groups(MaskData(None, data["key_valid"]), batch))


@pytest.mark.multirank
def test_head_groups_give_the_same_results_and_bytes_as_one_group(workers):
    per_rank = workers.get(4).run(_groups_task, CASES)
    for rank, results in enumerate(per_rank):
        for case, per_count in zip(CASES, results):
            one, four = per_count[1], per_count[4]
            # forward and backward, one head group each, in each batch group (a padded batch whose rows disagree)
            batch_groups = one[3]
            assert one[2] == [batch_groups] * 2, (rank, case, one[2])
            # the hybrid's ring runs on a node's share of the heads (Hkv / 2 = 2 here): two groups
            want = 1 if case[2] == "alibi" else 2 if case[0] == "ulysses" else 4
            assert four[2] == [want * batch_groups] * 2, (rank, case, four[2])
            # per head the same arithmetic, on head slices (strided when B > 1): the CPU kernels may round the last
            # bit differently, so the attention tolerances against the one-group result
            for name, a, b in zip(("out", "dq", "dk", "dv"), one[0], four[0]):
                assert torch.isfinite(a).all() and torch.isfinite(b).all(), (rank, case, name)
                allowed = tolerance(torch.float32, f"attention_{name}")
                diff, scale = (a - b).abs().max().item(), a.abs().max().item()
                assert diff <= allowed.atol + allowed.rtol * scale, (rank, case, name, diff, scale)
            assert one[1] == four[1], (rank, case)  # bytes per step and link, work per step
