"""Padded batches whose rows disagree run as groups of batch rows (:mod:`burstc.ops.batch_groups`).

Single-process: the grouping (a partition of the rows; split only where it pays; rows with no real key; the
forced limit).  Multi-rank (gloo): the op on right-, left- and un-padded rows of very different lengths, every
layout, both backward plans, flat ring at P = 2 and 3, against single-device SDPA; and the counters: split, every
rank receives exactly the per-group zero-redundancy bound in the forward, and sends and computes less than the
unsplit batch, whose results it matches.
"""
from __future__ import annotations

import math

import pytest
import torch

from burstc import layout as layouts
from burstc.attention_ir import Documents, KeyPadding, MaskSpec, SlidingWindow
from burstc.ops import ring_attention as ra
from burstc.ops.batch_groups import MAX_BATCH_GROUPS, batch_groups_forced, batch_row_groups, partition_rows
from burstc.ops.ring_loops import MaskData
from burstc.planner import data_zero_redundancy_bound
from burstc.testing import tolerance
from burstc.testing.balance import batch_groups_bound
from test_ring_runtime_masks import _sdpa_reference, _visible, error_vs

CAUSAL, PAD, DOCS = MaskSpec.causal(), KeyPadding("attention_mask"), Documents("position_ids")
HEADS_Q, HEADS_KV, HEAD_DIM = 4, 2, 8
COMPARED = ("out", "lse", "dq", "dk", "dv")
MASKS = {"causal&pad": CAUSAL & PAD, "full&pad": MaskSpec((PAD,)), "causal&window&pad": CAUSAL & SlidingWindow(5) & PAD,
         "causal&docs&pad": CAUSAL & DOCS & PAD}


def _cost(groups, first, stop):
    total = 0
    for rows in groups:
        real = [b for b in rows if stop[b] > first[b]]
        span = max((stop[b] for b in real), default=0) - min((first[b] for b in real), default=0)
        total += len(rows) * span ** 2
    return total


def test_rows_are_grouped_by_extent_only_where_it_pays():
    S = 8192
    # right padding at S, S/2, S/4, S/8: the longest row alone, the shortest two together (a fourth group saves 3%)
    assert partition_rows([0] * 4, [S, S // 2, S // 4, S // 8], 4) == [[0], [1], [2, 3]]
    assert partition_rows([0, 0], [S, S // 2], 4) == [[0], [1]]
    assert partition_rows([0] * 4, [S] * 4, 4) == [[0, 1, 2, 3]]                     # all alike: one group
    assert partition_rows([0] * 4, [S, S, S - 10, S - 5], 4) == [[0, 1, 2, 3]]        # too alike to pay
    assert partition_rows([0, S // 2, 0, S - S // 8], [S] * 4, 4) == [[0, 2], [1, 3]]  # left padding
    assert partition_rows([0, 0, 0], [S, 0, S // 4], 4) == [[0], [1, 2]]               # a row with no real key
    assert partition_rows([0] * 4, [S, S // 2, S // 4, S // 8], 1) == [[0, 1, 2, 3]]  # the limit
    assert partition_rows([0], [5], 4) == [[0]]


@pytest.mark.parametrize("seed", range(20))
def test_groups_partition_the_rows_and_never_cost_more(seed):
    generator = torch.Generator().manual_seed(seed)
    batch, seq_len = int(torch.randint(2, 13, (1,), generator=generator)), 64
    first = torch.randint(0, seq_len, (batch,), generator=generator)
    stop = torch.minimum(first + torch.randint(0, seq_len + 1, (batch,), generator=generator), torch.tensor(seq_len))
    first, stop = first.tolist(), stop.tolist()
    groups = partition_rows(first, stop, MAX_BATCH_GROUPS)
    assert sorted(b for rows in groups for b in rows) == list(range(batch))
    assert 1 <= len(groups) <= MAX_BATCH_GROUPS and all(rows == sorted(rows) and rows for rows in groups)
    whole = _cost([list(range(batch))], first, stop)
    assert _cost(groups, first, stop) <= (whole if len(groups) == 1 else 0.75 * whole)


def test_group_data_are_the_rows_of_the_call_data():
    valid = torch.ones(4, 16, dtype=torch.bool)
    valid[1, 8:] = valid[2, 4:] = valid[3, 2:] = False
    docs = torch.arange(64).reshape(4, 16)
    groups = batch_row_groups(MaskData(docs, valid), 4)
    assert [g.rows for g in groups] == [slice(0, 1), slice(1, 2), slice(2, 4)]
    assert torch.equal(groups[2].data.key_valid_BS, valid[2:]) and torch.equal(groups[2].data.doc_ids_BS, docs[2:])
    alternating = batch_row_groups(MaskData(None, valid[[0, 3, 0, 3]]), 4)  # rows 0, 2 long; 1, 3 short: indices
    assert [g.rows.tolist() for g in alternating] == [[0, 2], [1, 3]]
    assert torch.equal(alternating[1].data.key_valid_BS, valid[[3, 3]])
    with batch_groups_forced(1):
        assert len(batch_row_groups(MaskData(docs, valid), 4)) == 1
    assert len(batch_row_groups(MaskData(docs, None), 4)) == 1


def _padded_batch(seq_len: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Five rows: the whole length, right-padded to ~1/2 and to 3 tokens, left-padded to ~1/3, and no real key at
    all (its rows see nothing: out 0, lse -inf); document ids packed, boundaries every 7 tokens."""
    valid = torch.zeros(5, seq_len, dtype=torch.bool)
    valid[0] = True
    valid[1, :seq_len // 2 + 1] = True
    valid[2, :3] = True
    valid[3, seq_len - seq_len // 3:] = True
    docs = (torch.arange(seq_len) // 7).expand(5, -1).contiguous()
    return docs, valid


def _case(rank, world_size, layout, local_len, name, plan, forced_groups, dtype=torch.float32):
    seq_len, mask = local_len * world_size, MASKS[name]
    docs, valid = _padded_batch(seq_len)
    data = {"key_valid": valid, "doc_ids": docs if mask.term(Documents) else None}
    generator = torch.Generator().manual_seed(7)
    q, grad_out = (torch.randn(5, HEADS_Q, seq_len, HEAD_DIM, generator=generator) for _ in range(2))
    k, v = (torch.randn(5, HEADS_KV, seq_len, HEAD_DIM, generator=generator) for _ in range(2))
    pos = torch.arange(seq_len)
    reference = _sdpa_reference(q, k, v, grad_out, _visible(mask, pos, pos, docs, valid), 0.3)
    shard = lambda t: layouts.shard(t, 2, world_size, rank, layout)  # noqa: E731
    q_l, k_l, v_l = (shard(t).to(dtype).requires_grad_() for t in (q, k, v))
    with batch_groups_forced(forced_groups), ra.record_stats() as stats:
        out, lse = ra.ring_attention_with_lse(q_l, k_l, v_l, mask=mask, layout=layout, plan=plan, scale=0.3, **data)
        (out * shard(grad_out).to(dtype)).sum().backward()
    errors = {key: error_vs(got, shard(reference[key]))
              for key, got in {"out": out, "lse": lse, "dq": q_l.grad, "dk": k_l.grad, "dv": v_l.grad}.items()}
    forward, backward = stats.of("forward")[0], stats.of("backward")[0]
    counters = {op: (sum(s.bytes_received_per_step), sum(s.bytes_sent_per_step), sum(s.kernel_entries_per_step))
                for op, s in (("forward", forward), ("backward", backward))}
    return errors, counters, (forward.batch_groups, backward.batch_groups)


def _grid():
    return [(layout, 6 if layout == "zigzag" else 5, name, ra.PLANS[(i + j) % 2])
            for j, layout in enumerate(layouts.LAYOUTS) for i, name in enumerate(sorted(MASKS))]


def _run(rank, world_size, forced_groups):
    return [_case(rank, world_size, *case, forced_groups) for case in _grid()]


@pytest.mark.parametrize("world_size", [2, 3])
def test_grouped_batches_match_sdpa_and_move_less(workers, world_size):
    grouped = workers.get(world_size).run(_run, None)
    unsplit = workers.get(world_size).run(_run, 1)
    for rank in range(world_size):
        for case, (errors, counters, split), (errors_unsplit, counters_unsplit, unsplit_count) in zip(
                _grid(), grouped[rank], unsplit[rank]):
            # the counters say how many groups ran: the grouping's count, in both ops
            expected = len(batch_row_groups(MaskData(None, _padded_batch(case[1] * world_size)[1]), 5))
            assert expected > 1 and split == (expected, expected), (rank, case, split, expected)
            assert unsplit_count == (1, 1), (rank, case, unsplit_count)
            for key in COMPARED:
                allowed = tolerance(torch.float32, f"attention_{key}")
                for diff, scale in (errors[key], errors_unsplit[key]):
                    assert math.isfinite(diff) and diff <= allowed.atol + allowed.rtol * scale, (rank, case, key)
            for op in ("forward", "backward"):
                received, sent, entries = counters[op]
                received_unsplit, sent_unsplit, entries_unsplit = counters_unsplit[op]
                assert received <= received_unsplit and sent <= sent_unsplit, (rank, case, op)
                assert entries <= entries_unsplit, (rank, case, op, entries, entries_unsplit)
    for index, case in enumerate(_grid()):  # over the ranks: fewer bytes, and fewer kernel entries
        for op in ("forward", "backward"):
            (grouped_bytes, grouped_entries), (unsplit_bytes, unsplit_entries) = (
                [sum(per_rank[r][index][1][op][i] for r in range(world_size)) for i in (0, 2)]
                for per_rank in (grouped, unsplit))
            # the burst plan's query rows travel by the static mask (a key-padded pair moves them unless the data
            # hide the whole pair): the same bytes there at these lengths
            assert grouped_bytes < unsplit_bytes or (op, case[3]) == ("backward", "burst"), (case, op)
            # packed documents' blocks are already cut to each piece's real keys, and a window's band at these
            # lengths is one position-masked block per pair: the same entries there
            assert grouped_entries < unsplit_entries or case[2] not in ("causal&pad", "full&pad"), (case, op)


def _bf16_cases(rank, world_size, plan):
    return [_case(rank, world_size, layout, 6, name, plan, None, torch.bfloat16)
            for layout, name in (("zigzag", "causal&pad"), ("striped", "causal&docs&pad"))]


@pytest.mark.parametrize("plan", ra.PLANS)
def test_grouped_batches_in_bf16_match_sdpa(workers, plan):
    """bf16 shards (fp32 accumulation inside the loops), each batch group's results placed into the bf16 outputs."""
    for rank, results in enumerate(workers.get(2).run(_bf16_cases, plan)):
        expected = len(batch_row_groups(MaskData(None, _padded_batch(12)[1]), 5))
        for errors, _, split in results:
            assert expected > 1 and split == (expected, expected), (rank, plan, split, expected)
            for key in COMPARED:
                allowed = tolerance(torch.bfloat16, f"attention_{key}")
                diff, scale = errors[key]
                assert math.isfinite(diff) and diff <= allowed.atol + allowed.rtol * scale, (rank, plan, key, diff)


def _forward_received(rank, world_size, name):
    seq_len, mask = 12 * world_size, MASKS[name]
    docs, valid = _padded_batch(seq_len)
    generator = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(5, 2, seq_len, HEAD_DIM, generator=generator) for _ in range(3))
    shard = lambda t: layouts.shard(t, 2, world_size, rank, "zigzag")  # noqa: E731
    with ra.record_stats() as stats:
        ra.ring_attention(shard(q), shard(k), shard(v), mask=mask, layout="zigzag", key_valid=valid,
                          doc_ids=docs if mask.term(Documents) else None)
    groups = [g.rows for g in batch_row_groups(MaskData(docs, valid), 5)]
    return sum(stats.of("forward")[0].bytes_received_per_step), [
        (r.start, r.stop) if isinstance(r, slice) else r.tolist() for r in groups]


@pytest.mark.parametrize("name", ["causal&pad", "full&pad"])
def test_each_group_receives_exactly_its_zero_redundancy_bound(workers, name):
    world_size = 3
    seq_len = 12 * world_size
    docs, valid = _padded_batch(seq_len)
    per_rank = workers.get(world_size).run(_forward_received, name)
    groups = per_rank[0][1]
    assert len(groups) > 1, groups
    bound = list(batch_groups_bound("zigzag", MASKS[name], seq_len, world_size, 5, 2, 2, HEAD_DIM, torch.float32,
                                    None, valid)["forward"])
    assert [received for received, _ in per_rank] == bound
    # between the bound of a ring that sent each batch row alone and the unsplit batch's
    per_row = data_zero_redundancy_bound("zigzag", MASKS[name], seq_len, world_size, 5, 2, 2, HEAD_DIM, torch.float32,
                                         key_valid_BS=valid, per_batch_row=True)["forward"]
    union = data_zero_redundancy_bound("zigzag", MASKS[name], seq_len, world_size, 5, 2, 2, HEAD_DIM, torch.float32,
                                       key_valid_BS=valid)["forward"]
    assert all(a <= b < c for a, b, c in zip(per_row, bound, union)), (per_row, bound, union)
