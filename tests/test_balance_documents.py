"""The document balancer (:mod:`burstc.balance_documents`) and the document schemes of the balance simulator
(:func:`burstc.testing.balance.simulate_documents`): invariants, exactness of the work counts, the balancer against
a brute-force optimum on tiny cases, and the torch schemes against torch's own index generators."""
from __future__ import annotations

import itertools

import pytest
import torch

from burstc.balance_documents import (assign_documents, balance_chunks, chunk_work, document_ids_of_lengths,
                                      keys_seen)
from burstc.testing.balance import DOCUMENT_SCHEMES, sample_document_lengths, simulate_documents


@pytest.fixture(autouse=True)
def one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # many tiny tensor ops
    yield
    torch.set_num_threads(threads)


def brute_keys_seen(doc_ids):
    return [sum(1 for j in range(i + 1) if doc_ids[j] == doc_ids[i]) for i in range(len(doc_ids))]


@pytest.mark.parametrize("ids", [[0, 0, 0, 1, 1, 2, 2, 2, 2], [3, 3, 1, 1, 3, 1, 0, 3, 3, 1]])  # packed; reused ids
def test_keys_seen_is_the_causal_documents_row_count(ids):
    assert keys_seen(torch.tensor(ids)).tolist() == brute_keys_seen(ids)


def test_chunk_work_sums_to_the_mask_area():
    lengths = [5, 17, 1, 9, 32]
    weights = chunk_work(document_ids_of_lengths(lengths), 8)
    assert len(weights) == 8 and sum(weights) == sum(n * (n + 1) // 2 for n in lengths)
    with pytest.raises(ValueError, match="equal chunks"):
        chunk_work(document_ids_of_lengths(lengths), 5)


@pytest.mark.parametrize("world_size,chunks_per_rank", [(2, 2), (4, 3), (8, 4), (3, 8)])
def test_assignment_invariants(world_size, chunks_per_rank):
    generator = torch.Generator().manual_seed(world_size * 100 + chunks_per_rank)
    seq_len = 96 * world_size * chunks_per_rank
    doc_ids = document_ids_of_lengths(sample_document_lengths(seq_len, generator))
    found = assign_documents(doc_ids, world_size, chunks_per_rank)
    assert all(len(chunks) == chunks_per_rank for chunks in found.chunks)
    assert all(list(chunks) == sorted(chunks) for chunks in found.chunks)  # a rank's tokens in global order
    permutation = found.permutation()
    assert sorted(permutation.tolist()) == list(range(seq_len))
    for rank in range(world_size):
        positions = found.positions(rank)
        assert positions.numel() == seq_len // world_size and bool((positions[1:] > positions[:-1]).all())
    seen = keys_seen(doc_ids)
    assert found.work == tuple(int(seen[found.positions(r)].sum()) for r in range(world_size))
    # deterministic: the same ids give the same assignment (every rank computes it alone)
    assert assign_documents(doc_ids.clone(), world_size, chunks_per_rank) == found


def _optimum(weights, world_size):
    """The least possible busiest load over all splits of the chunks into equal-count groups."""
    per_rank, best = len(weights) // world_size, None

    def split(left, loads):
        nonlocal best
        if not left:
            best = max(loads) if best is None else min(best, max(loads))
            return
        first, rest = left[0], left[1:]
        for others in itertools.combinations(rest, per_rank - 1):
            group = (first, *others)
            load = sum(weights[c] for c in group)
            if best is None or load < best:
                split([c for c in rest if c not in others], loads + [load])

    split(list(range(len(weights))), [])
    return best


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("world_size,chunks_per_rank", [(2, 4), (4, 2), (3, 3)])
def test_balancer_reaches_the_brute_force_optimum_on_tiny_cases(seed, world_size, chunks_per_rank):
    generator = torch.Generator().manual_seed(seed)
    seq_len = 16 * world_size * chunks_per_rank
    doc_ids = document_ids_of_lengths(sample_document_lengths(seq_len, generator, longest=seq_len // 2))
    weights = chunk_work(doc_ids, world_size * chunks_per_rank)
    found = assign_documents(doc_ids, world_size, chunks_per_rank)
    optimum = _optimum(weights, world_size)
    assert max(found.work) == optimum, (weights, found.chunks, optimum)


def test_adaptive_chunks_reach_the_target_with_the_fewest_chunks():
    # equal documents of S/4 on 8 ranks: the head-tail snake is exact with k = 2
    equal = assign_documents(document_ids_of_lengths([4096] * 4), 8)
    assert len(equal.chunks[0]) == 2 and equal.max_over_mean == 1.0
    # mixed long documents: k = 2 leaves a heavy chunk far above the mean; the adaptive k is the first power of two
    # that reaches 1.01
    skewed = document_ids_of_lengths([4096, 1000, 3000, 500, 4096, 3692])
    adaptive = assign_documents(skewed, 8)
    k = len(adaptive.chunks[0])
    assert k > 2 and adaptive.max_over_mean <= 1.01 < assign_documents(skewed, 8, k // 2).max_over_mean
    assert assign_documents(skewed, 8, 2).max_over_mean > 1.05


def test_balance_chunks_rejects_uneven_splits():
    with pytest.raises(ValueError, match="evenly"):
        balance_chunks([1, 2, 3], 2)
    with pytest.raises(ValueError, match="at least 2"):
        assign_documents(document_ids_of_lengths([8]), 2, 1)


# -- the simulator's document schemes -----------------------------------------------------------------------------

@pytest.mark.parametrize("world_size", [2, 4])
def test_every_scheme_counts_the_same_total_work(world_size):
    lengths = sample_document_lengths(2048, torch.Generator().manual_seed(world_size))
    total = sum(n * (n + 1) // 2 for n in lengths)
    for scheme in DOCUMENT_SCHEMES:
        found = simulate_documents(lengths, world_size, scheme)
        assert sum(found.work) == total, scheme
        assert sum(found.tokens) == 2048 + found.padding, scheme
        assert found.work_max_over_mean >= 1.0


def test_torch_schemes_match_torch_generators():
    from torch.distributed.tensor.experimental._context_parallel._load_balancer import \
        _PerDocumentHeadTailLoadBalancer

    lengths, world_size = [16, 48, 8, 24, 32], 2  # every length a multiple of 2P: torch's generator runs
    indices = _PerDocumentHeadTailLoadBalancer([lengths], world_size, "cpu")._generate_indices()[0]
    seen = keys_seen(document_ids_of_lengths(lengths))
    # as shipped: the rearranged sequence cut into P equal slices, as context parallelism shards it
    shipped = tuple(int(seen[part].sum()) for part in indices.chunk(world_size))
    assert simulate_documents(lengths, world_size, "torch_head_tail").work == shipped
    # as drawn: each document's pieces r and 2P-1-r on rank r
    pieces = [indices[start:start + n].view(world_size, -1) for start, n in
              zip(torch.tensor([0, *lengths[:-1]]).cumsum(0).tolist(), lengths)]
    intended = tuple(int(sum(seen[p[r]].sum() for p in pieces)) for r in range(world_size))
    assert simulate_documents(lengths, world_size, "torch_head_tail_intended").work == intended
    te = simulate_documents(lengths, world_size, "te_padded")
    assert te.padding == 0 and te.work == intended
    assert shipped != intended  # the shipped order is not the drawn one


def test_te_padding_and_burstc_target_on_sampled_mixes():
    generator = torch.Generator().manual_seed(7)
    mixes = [sample_document_lengths(16384, generator, longest=4096) for _ in range(12)]
    for world_size in (4, 8):
        ours = [simulate_documents(mix, world_size, "burstc") for mix in mixes]
        assert max(f.work_max_over_mean for f in ours) <= 1.02
        assert all(f.padding == 0 and len(set(f.tokens)) == 1 for f in ours)
        zigzag = [simulate_documents(mix, world_size, "zigzag").work_max_over_mean for mix in mixes]
        assert max(zigzag) > 1.2  # what the balancer fixes
        te = [simulate_documents(mix, world_size, "te_padded") for mix in mixes]
        assert all(f.padding == sum(-(-n // (2 * world_size)) * (2 * world_size) - n for n in mix)
                   for f, mix in zip(te, mixes))


# -- the per-call choice between the balanced chunks and zigzag's (the cost model's prices) -------------------------


def _packed_ids(batch: int, seq_len: int, seed: int, start_probability: float = 0.03) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    starts = torch.rand(batch, seq_len, generator=generator) < start_probability
    starts[:, 0] = True
    return starts.long().cumsum(1)


def test_zigzag_owners_are_the_zigzag_layout():
    from burstc.balance_documents import zigzag_owners
    from burstc.layout import ChunkLayout, local_positions

    for world_size, chunks_per_rank in ((2, 2), (3, 4), (4, 8)):
        seq_len = 4 * chunks_per_rank * world_size
        layout = ChunkLayout.from_owners(zigzag_owners(world_size, chunks_per_rank), seq_len)
        for rank in range(world_size):
            assert torch.equal(local_positions(seq_len, world_size, rank, layout),
                               local_positions(seq_len, world_size, rank, "zigzag")), (world_size, rank)


@pytest.mark.parametrize("batch", [1, 2])
def test_rows_needed_is_the_data_zero_redundancy_bound(batch):
    """What the cost prices per rank is what the ring receives with packed documents: the data's bound."""
    from burstc.attention_ir import Documents, MaskSpec
    from burstc.balance_documents import chunk_owners, rows_needed, zigzag_owners
    from burstc.layout import ChunkLayout
    from burstc.planner import data_zero_redundancy_bound

    seq_len, world_size, chunks_per_rank = 192, 3, 8
    mask = MaskSpec.causal() & Documents("doc_ids")
    for seed in range(3):
        ids = _packed_ids(batch, seq_len, seed, 0.05)
        for owners in (chunk_owners(ids, world_size, chunks_per_rank), zigzag_owners(world_size, chunks_per_rank)):
            bound = data_zero_redundancy_bound(ChunkLayout.from_owners(owners, seq_len), mask, seq_len, world_size,
                                               batch, 1, 1, 1, torch.float32, doc_ids_BS=ids)
            row_bytes = 2 * batch * 4  # a K and a V row of every batch row, one head of dim 1, fp32
            got = rows_needed(ids, owners.repeat_interleave(seq_len // owners.numel()), world_size)
            assert got.tolist() == [b // row_bytes for b in bound["forward"]], (seed, owners)


def test_rows_needed_of_one_row_is_the_batch_count_of_that_row_twice():
    """One row takes the O(S + P * documents) path, a batch the per-rank pass: the same counts (ids sorted or
    reused out of order, any owners)."""
    from burstc.balance_documents import rows_needed

    generator = torch.Generator().manual_seed(1)
    for trial in range(10):
        ids = _packed_ids(1, 240, seed=trial, start_probability=0.05)[0]
        if trial % 2:
            ids = ids % 3
        owner_S = torch.randint(0, 4, (240,), generator=generator)
        assert torch.equal(rows_needed(ids[None], owner_S, 4), rows_needed(torch.stack([ids, ids]), owner_S, 4))


def test_the_cost_picks_zigzag_behind_slow_links_and_balanced_chunks_otherwise():
    from burstc.balance_documents import chunk_owners, chunk_owners_by_cost, predicted_seconds, zigzag_owners
    from burstc.ops import document_layout

    seq_len, world_size, chunks_per_rank = 1024, 4, 8
    ids = _packed_ids(1, seq_len, seed=5)
    balanced, zigzag = chunk_owners(ids, world_size, chunks_per_rank), zigzag_owners(world_size, chunks_per_rank)
    assert not torch.equal(balanced, zigzag)
    # compute alone: the balanced chunks (their busiest rank has less work); links alone: zigzag (fewer rows here)
    owners, choice = chunk_owners_by_cost(ids, world_size, chunks_per_rank, 1.0, 1e-12)
    assert choice == "balanced" and torch.equal(owners, balanced)
    assert predicted_seconds(ids, zigzag, world_size, 1.0, 0.0) > predicted_seconds(ids, balanced, world_size, 1.0, 0.0)
    assert predicted_seconds(ids, zigzag, world_size, 0.0, 1.0) < predicted_seconds(ids, balanced, world_size, 0.0, 1.0)
    owners, choice = chunk_owners_by_cost(ids, world_size, chunks_per_rank, 1e-12, 1.0)
    assert choice == "zigzag" and torch.equal(owners, zigzag)
    # the op: without prices the balanced chunks, with them the cheaper; its counter says which it took
    before = document_layout.choices()
    assert torch.equal(torch.ops.burstc.document_chunks(ids, world_size, chunks_per_rank), balanced)
    assert torch.equal(torch.ops.burstc.document_chunks(ids, world_size, chunks_per_rank, 1e-12, 1.0), zigzag)
    after = document_layout.choices()
    assert (after["balanced"] - before["balanced"], after["zigzag"] - before["zigzag"]) == (1, 1)
