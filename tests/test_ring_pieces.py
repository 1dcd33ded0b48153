"""The ring's single-process pieces: block geometry against the dense mask reference, the ring's
posting order, and the op's sequence-parallel spec / mask arguments (no process group needed)."""
from __future__ import annotations

import contextlib

import pytest
import torch
import torch.distributed as dist

from burstc import layout as layouts
from burstc.attention_ir import Documents, KeyPadding, MaskSpec, SlidingWindow
from burstc.ops import ring_attention as ra
from burstc.block_geometry import CAUSAL, FULL, Block, blocks
from burstc.ops.ring_comm import Ring

MASKS = {"full": MaskSpec.full(), "causal": MaskSpec.causal()}


def _local_lens(layout):
    return (2, 4, 6) if layout == "zigzag" else (1, 2, 3, 5)


@pytest.mark.parametrize("mask_name", sorted(MASKS))
@pytest.mark.parametrize("layout", layouts.LAYOUTS)
@pytest.mark.parametrize("world_size", [1, 2, 3, 4])
def test_blocks_cover_exactly_the_visible_entries(layout, world_size, mask_name):
    """Every (query rank, kv rank) pair: the blocks cover each visible entry once and nothing else,
    their score_entries add up to the visible count, and () comes exactly when nothing is visible."""
    mask = MASKS[mask_name]
    for local_len in _local_lens(layout):
        seq_len = local_len * world_size
        positions = [layouts.local_positions(seq_len, world_size, r, layout) for r in range(world_size)]
        for q_owner in range(world_size):
            for kv_owner in range(world_size):
                context = (layout, mask_name, world_size, local_len, q_owner, kv_owner)
                visible = mask.visible(positions[q_owner], positions[kv_owner])
                found = blocks(layout, mask, q_owner, kv_owner, local_len, world_size)
                assert isinstance(found, tuple), context
                assert (found == ()) == (not bool(visible.any())), context
                times_covered = torch.zeros(visible.shape, dtype=torch.int64)
                for block in found:
                    assert isinstance(block, Block) and block.mask in (FULL, CAUSAL), context
                    rows, cols = block.q_stop - block.q_start, block.kv_stop - block.kv_start
                    assert rows > 0 and cols > 0, context
                    own = torch.ones(rows, cols, dtype=torch.int64)
                    own = own.tril() if block.causal else own
                    times_covered[block.q_rows, block.kv_rows] += own
                    assert block.score_entries == int(own.sum()), context
                assert torch.equal(times_covered, visible.to(torch.int64)), (context, found)
                assert sum(b.score_entries for b in found) == int(visible.sum()), context


@pytest.mark.parametrize("layout", layouts.LAYOUTS)
@pytest.mark.parametrize("world_size", [1, 2, 3, 4])
def test_unshard_inverts_shard(layout, world_size):
    """The shards hold the layout's positions and unshard puts them back in global order."""
    seq_len = 2 * world_size * 3
    x_BSD = torch.randn(2, seq_len, 3)
    shards = [layouts.shard(x_BSD, 1, world_size, r, layout) for r in range(world_size)]
    for r, shard in enumerate(shards):
        assert torch.equal(shard, x_BSD[:, layouts.local_positions(seq_len, world_size, r, layout)])
    assert torch.equal(layouts.unshard(shards, 1, layout), x_BSD)


@pytest.mark.parametrize("rows,cols", [(4, 4), (5, 3), (3, 5), (1, 7)])
def test_block_score_entries(rows, cols):
    assert Block(0, rows, 0, cols, FULL).score_entries == rows * cols
    assert Block(2, 2 + rows, 1, 1 + cols, CAUSAL).score_entries == int(torch.ones(rows, cols).tril().sum())


@pytest.mark.parametrize("mask", [MaskSpec.causal() & SlidingWindow(3) & Documents("doc_ids"),
                                  MaskSpec.causal() & Documents("doc_ids"), MaskSpec((KeyPadding("attention_mask"),))])
def test_blocks_refuse_masks_the_ring_does_not_execute(mask):
    with pytest.raises(NotImplementedError, match=mask.encode().replace("(", r"\(").replace(")", r"\)")):
        blocks("zigzag", mask, 0, 1, 4, 2)


def test_blocks_reject_impossible_geometry():
    with pytest.raises(ValueError, match="cannot hold 5"):
        blocks("zigzag", MaskSpec.causal(), 0, 1, 5, 2)
    with pytest.raises(ValueError, match="outside"):
        blocks("striped", MaskSpec.causal(), 0, 2, 4, 2)
    with pytest.raises(ValueError, match="block mask"):
        Block(0, 1, 0, 1, "sliding")


def test_ring_posts_receives_before_sends(monkeypatch):
    """With gloo, a send-first batch makes one direction wait behind the other's data."""
    posted = []
    monkeypatch.setattr(dist, "batch_isend_irecv", lambda ops: posted.extend(ops) or [])
    monkeypatch.setattr(dist, "P2POp", lambda op, tensor, peer, group: (op, tensor, peer))
    monkeypatch.setattr(dist, "get_global_rank", lambda group, rank: rank)
    ring = Ring.__new__(Ring)
    ring.group, ring.size, ring.rank, ring.timeout_s = None, 3, 1, None

    class Recorder:
        sent_bytes = received_bytes = 0

        def sent(self, step, tensors, link):
            self.sent_bytes += sum(t.numel() * t.element_size() for t in tensors)

        def received(self, step, tensors, link):
            self.received_bytes += sum(t.numel() * t.element_size() for t in tensors)

        def posting(self, step, describe):
            assert describe() == [("recv", 0, 5 * 4, 2), ("send", 2, 5 * 4, 2)]
            return contextlib.nullcontext()

    sends, recvs, recorder = [torch.zeros(2), torch.zeros(3)], [torch.empty(2), torch.empty(3)], Recorder()
    assert ring.post_between([(1, sends)], [(-1, recvs)], recorder, 0) == []
    assert [(op, peer) for op, _, peer in posted] == [(dist.irecv, 0), (dist.irecv, 0), (dist.isend, 2), (dist.isend, 2)]
    assert [t for _, t, _ in posted] == recvs + sends
    assert recorder.sent_bytes == recorder.received_bytes == 5 * 4


def test_op_takes_one_two_or_the_hybrids_three_group_names():
    q = torch.randn(1, 2, 4, 8)
    with pytest.raises(NotImplementedError, match=r"one process group \(a flat ring\), two .* got 3"):
        torch.ops.burstc.ring_attention_forward(q, q, q, ["a", "b", "c"], "zigzag", "causal", 0.5, "kv_ring")


def test_public_api_mask_arguments():
    q = torch.randn(1, 2, 4, 8)
    with pytest.raises(NotImplementedError, match="documents"):
        ra.ring_attention(q, q, q, mask=MaskSpec.causal() & Documents("doc_ids"))
    with pytest.raises(ValueError, match="causal= or mask="):
        ra.ring_attention(q, q, q, causal=True, mask=MaskSpec.causal())
    assert ra._resolve_mask(None, None) == ra._resolve_mask(True, None) == MaskSpec.causal()
    assert ra._resolve_mask(False, None) == ra._resolve_mask(None, MaskSpec.full()) == MaskSpec.full()
