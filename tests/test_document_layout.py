"""The documents layout (``layout="documents"``): each call's chunks of a packed sequence assigned to balance its
document-causal work, and the ring's blocks trimmed to the documents.

Single-process: :class:`ChunkLayout` positions, ``burstc::document_chunks``' owners (equal chunks per rank, every
chunk owned, coarse assignments spread over the finest chunks), the block geometry of a chunk layout and the
document trimming (every visible entry covered exactly once, against the dense reference; fewer kernel entries).
Multi-rank (gloo): the ring op on chunk layouts (P = 2, 3; both backward plans; documents with and without padding,
sorted ids and ids out of order) against single-device SDPA with the dense mask, its work counters, and the
kernel entries falling with the documents.
"""
from __future__ import annotations

import math

import pytest
import torch

from burstc import layout as layouts
from burstc.attention_ir import Documents, KeyPadding, MaskSpec
from burstc.balance_documents import assign_documents, chunk_owners, document_ids_of_lengths, finest_chunks_per_rank
from burstc.block_geometry import Block, blocks, trim_blocks_to_documents
from burstc.layout import ChunkLayout
from burstc.ops import ring_attention as ra
from burstc.testing import tolerance

from test_ring_runtime_masks import _sdpa_reference, _visible, error_vs

CAUSAL = MaskSpec.causal()
DOCS, PAD = Documents("doc_ids"), KeyPadding("attention_mask")
BATCH, HEADS_Q, HEADS_KV, HEAD_DIM = 2, 4, 2, 8


def _packed_ids(seq_len: int, generator: torch.Generator, batch: int = BATCH) -> torch.Tensor:
    """``[B, S]`` sorted document ids with random boundaries (lengths 1 included)."""
    starts_BS = torch.rand(batch, seq_len, generator=generator) < 0.2
    starts_BS[:, 0] = True
    return starts_BS.long().cumsum(1) - 1


def test_chunk_layout_positions_and_checks():
    chunks = ChunkLayout(2, (1, 0, 0, 1))
    assert chunks.world_size == 2 and chunks.seq_len == 8
    assert layouts.local_positions(8, 2, 0, chunks).tolist() == [2, 3, 4, 5]
    assert layouts.local_positions(8, 2, 1, chunks).tolist() == [0, 1, 6, 7]
    assert layouts.required_multiple(2, "documents") == 4
    with pytest.raises(ValueError, match="same number of chunks"):
        ChunkLayout(2, (0, 0, 1))
    with pytest.raises(ValueError, match="has no rank"):
        layouts.local_positions(12, 2, 0, chunks)
    with pytest.raises(ValueError, match="chosen per call"):
        layouts.local_positions(8, 2, 0, "documents")
    with pytest.raises(ValueError, match="given exactly for layout 'documents'"):
        layouts.resolve_layout("documents", None, 8)
    assert layouts.resolve_layout("documents", torch.tensor([1, 0, 0, 1]), 8) == chunks


@pytest.mark.parametrize("world_size", [2, 3, 4])
def test_document_chunks_op_gives_every_rank_equal_chunks(world_size):
    generator = torch.Generator().manual_seed(world_size)
    for seq_len in (4 * world_size, 24 * world_size, 128 * world_size):
        finest = finest_chunks_per_rank(seq_len, world_size)
        ids_BS = _packed_ids(seq_len, generator)
        owners = torch.ops.burstc.document_chunks(ids_BS, world_size, finest)
        assert owners.dtype == torch.int64 and owners.shape == (finest * world_size,)
        assert torch.bincount(owners, minlength=world_size).tolist() == [finest] * world_size
        # the same assignment the balancer finds, spread over the finest chunks
        found = assign_documents(ids_BS, world_size, max_chunks_per_rank=finest)
        chunks = ChunkLayout.from_owners(owners, seq_len)
        for rank in range(world_size):
            assert torch.equal(chunks.positions_PL[rank], torch.cat(
                [torch.arange(c * found.chunk_len, (c + 1) * found.chunk_len) for c in found.chunks[rank]]))
    assert finest_chunks_per_rank(6, 2) == 0 and finest_chunks_per_rank(8, 2) == 4 and finest_chunks_per_rank(12, 2) == 2


def test_balanced_chunks_even_the_work_of_a_batch():
    """Two rows whose long documents sit at opposite ends: zigzag is uneven, the chunks even (max/mean <= 1.02)."""
    seq_len, world_size = 512, 4
    row = document_ids_of_lengths([16] * 8 + [384])
    ids_BS = torch.stack([row, row.flip(0).max() - row.flip(0)])
    owners = chunk_owners(ids_BS, world_size, finest_chunks_per_rank(seq_len, world_size))
    chunks = ChunkLayout.from_owners(owners, seq_len)
    pos = torch.arange(seq_len)
    visible_B1SS = _visible(CAUSAL & DOCS, pos, pos, ids_BS, torch.ones_like(ids_BS, dtype=torch.bool))

    def max_over_mean(layout):
        work = [int(visible_B1SS[:, :, layouts.local_positions(seq_len, world_size, r, layout)].sum())
                for r in range(world_size)]
        return max(work) / (sum(work) / world_size)

    assert max_over_mean(chunks) <= 1.02 < 1.1 < max_over_mean("zigzag")


def _covered_once(found, q_pos, kv_pos, mask, ids_BS) -> bool:
    """Every visible entry of the pair (any batch row) inside exactly one block, and a ``data_free`` block's
    static kind (full, top-left causal) exactly what every batch row sees inside it."""
    visible_BQK = _visible(mask, q_pos, kv_pos, ids_BS, torch.ones_like(ids_BS, dtype=torch.bool))[:, 0]
    visible = visible_BQK.any(0)
    cover = torch.zeros(len(q_pos), len(kv_pos), dtype=torch.int64)
    for block in found:
        cover[block.q_rows, block.kv_rows] += 1
        if block.data_free:
            rows, cols = block.q_stop - block.q_start, block.kv_stop - block.kv_start
            kind = torch.ones(rows, cols, dtype=torch.bool)
            kind = kind.tril() if block.mask == "causal" else kind
            if not all(torch.equal(v[block.q_rows, block.kv_rows], kind) for v in visible_BQK):
                return False
    return bool((cover[visible] == 1).all()) and int(cover.max()) <= 1


@pytest.mark.parametrize("seed", range(4))
def test_trimmed_blocks_cover_the_documents_exactly_once(seed, monkeypatch):
    """Chunk and static layouts, every pair: the trimmed blocks cover every visible entry once and evaluate under
    half the static blocks' entries (no merge slack: these toy blocks are far smaller than a kernel call's worth)."""
    monkeypatch.setattr("burstc.block_geometry.MERGE_SLACK_ENTRIES", 0)
    generator = torch.Generator().manual_seed(seed)
    world_size, seq_len = 3, 96
    batch = 1 + seed % 2  # two rows with different documents rarely leave a one-document box
    ids_BS = _packed_ids(seq_len, generator, batch)
    owners = chunk_owners(ids_BS, world_size, finest_chunks_per_rank(seq_len, world_size))
    for layout in (ChunkLayout.from_owners(owners, seq_len), "zigzag", "contiguous", "striped"):
        static_entries = trimmed_entries = data_free = 0
        for q_owner in range(world_size):
            for kv_owner in range(world_size):
                q_pos, kv_pos = (layouts.local_positions(seq_len, world_size, r, layout) for r in (q_owner, kv_owner))
                static = blocks(layout, CAUSAL, q_owner, kv_owner, seq_len // world_size, world_size)
                trimmed = trim_blocks_to_documents(static, q_pos, kv_pos, ids_BS)
                assert _covered_once(trimmed, q_pos, kv_pos, CAUSAL & DOCS, ids_BS), (layout, q_owner, kv_owner)
                assert all(b.mask == "positions" or b.data_free for b in trimmed)
                data_free += sum(b.data_free for b in trimmed)
                static_entries += sum(b.kernel_entries for b in static)
                trimmed_entries += sum(b.kernel_entries for b in trimmed)
        assert trimmed_entries < static_entries / 2, (layout, trimmed_entries, static_entries)
        assert data_free > 0 or batch > 1, layout  # one-document boxes keep the flash-style kernels


def test_trimming_merges_tiny_documents_into_few_blocks():
    """Single-token documents: one block per document would be 64 kernel calls; with the default slack they merge
    into one."""
    ids_BS = torch.arange(64)[None]
    static = (Block(0, 64, 0, 64, "causal"),)
    trimmed = trim_blocks_to_documents(static, torch.arange(64), torch.arange(64), ids_BS)
    assert len(trimmed) == 1 and trimmed[0].kernel_entries <= 64 * 64
    assert _covered_once(trimmed, torch.arange(64), torch.arange(64), CAUSAL & DOCS, ids_BS)


# ---------------------------------------------------------------------------------------------
# The op on gloo worker groups

MASKS = {"causal&docs": CAUSAL & DOCS, "causal&docs&pad": CAUSAL & DOCS & PAD}


def _run_chunk_layouts(rank, world_size, cases):
    import burstc.block_geometry as geometry

    slack, geometry.MERGE_SLACK_ENTRIES = geometry.MERGE_SLACK_ENTRIES, 0  # toy blocks: trim without merging
    try:
        return _chunk_layout_cases(rank, world_size, cases)
    finally:
        geometry.MERGE_SLACK_ENTRIES = slack


def _chunk_layout_cases(rank, world_size, cases):
    results = []
    for index, (name, local_len, plan, shuffled, batch) in enumerate(cases):
        seq_len, mask = local_len * world_size, MASKS[name]
        generator = torch.Generator().manual_seed(200 + index)
        ids_BS = _packed_ids(seq_len, generator, batch)
        if shuffled:  # ids out of order: no trimming, the pair skip and the element-wise mask still exact
            ids_BS = ids_BS % 3
        key_valid_BS = torch.ones(batch, seq_len, dtype=torch.bool)
        key_valid_BS[0, seq_len - 3:] = False
        key_valid_BS[-1, :2] = False
        chunks = ChunkLayout.from_owners(chunk_owners(ids_BS, world_size, finest_chunks_per_rank(
            seq_len, world_size)), seq_len)
        data = {"doc_ids": ids_BS, "key_valid": key_valid_BS if mask.term(KeyPadding) else None}
        q, grad_out = (torch.randn(batch, HEADS_Q, seq_len, HEAD_DIM, generator=generator) for _ in range(2))
        k, v = (torch.randn(batch, HEADS_KV, seq_len, HEAD_DIM, generator=generator) for _ in range(2))
        pos = torch.arange(seq_len)
        visible = _visible(mask, pos, pos, ids_BS, key_valid_BS)
        reference = _sdpa_reference(q, k, v, grad_out, visible, 0.3)
        mine = layouts.local_positions(seq_len, world_size, rank, chunks)
        shard = lambda t: t.index_select(2, mine)  # noqa: E731
        q_l, k_l, v_l = (shard(t).requires_grad_() for t in (q, k, v))
        with ra.record_stats() as stats:
            out, lse = ra.ring_attention_with_lse(q_l, k_l, v_l, mask=mask, layout=chunks, plan=plan, scale=0.3,
                                                  **data)
            (out * shard(grad_out)).sum().backward()
        errors = {key: error_vs(got, shard(reference[key]))
                  for key, got in {"out": out, "lse": lse, "dq": q_l.grad, "dk": k_l.grad, "dv": v_l.grad}.items()}
        forward = stats.of("forward")[0]
        expected_work = int(visible[:, :, mine].sum()) * HEADS_Q
        results.append((errors, forward.total_work == expected_work, sum(forward.kernel_entries_per_step),
                        forward.layout))
    return results


CASES = [("causal&docs", 8, "burst", False, BATCH), ("causal&docs", 12, "kv_ring", False, BATCH),
         ("causal&docs&pad", 8, "kv_ring", False, BATCH), ("causal&docs&pad", 8, "burst", True, BATCH),
         # one batch row: most boxes lie in one document and keep the flash-style kernels
         ("causal&docs", 16, "burst", False, 1), ("causal&docs&pad", 16, "kv_ring", False, 1)]


@pytest.mark.parametrize("world_size", [2, 3])
def test_ring_on_chunk_layouts_matches_sdpa(workers, world_size):
    per_rank = workers.get(world_size).run(_run_chunk_layouts, CASES)
    for rank, results in enumerate(per_rank):
        for case, (errors, work_matches, kernel_entries, layout_name) in zip(CASES, results):
            assert work_matches and layout_name == "documents", (rank, case)
            for key, (diff, scale) in errors.items():
                allowed = tolerance(torch.float32, f"attention_{key}")
                assert math.isfinite(diff) and diff <= allowed.atol + allowed.rtol * scale, (rank, case, key, diff)
    # sorted ids: the kernels evaluate well under the causal square; ids out of order: no trimming
    seq_len = 8 * world_size
    causal_square = BATCH * HEADS_Q * seq_len * (seq_len + 1) // 2
    assert sum(results[0][2] for results in per_rank) < causal_square


def test_packed_hf_model_under_inductor_uses_the_documents_layout(workers):
    """``burstc.compile`` defaults (``layout="auto"``) on a packed HF Llama batch, Inductor: the documents layout,
    loss and every parameter gradient equal single-device eager."""
    pytest.importorskip("transformers")
    from burstc.testing import assert_equivalent, zoo

    results = assert_equivalent(zoo.hf_llama, zoo.hf_inputs, zoo.hf_loss_packed, world_size=2, group=workers.get(2),
                                backend="inductor", expect_sharded=True, timeout=600)
    details = results[0]["shard_details"]
    assert details["layout"] == "documents" and details["layout_reason"].startswith("documents"), details
    # the call's owners op gets the cost model's prices (balanced chunks or zigzag's, per call)
    assert details["document_prices"]["seconds_per_entry"] > 0 and details["document_prices"]["seconds_per_row"] > 0
