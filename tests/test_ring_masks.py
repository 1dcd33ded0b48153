"""Static masks in the ring: sliding windows (one- and two-sided), ALiBi and soft-cap.

Single-process: the block geometry against :meth:`MaskSpec.visible`, and the position-masked block
kernels against a dense autograd reference.  Multi-rank (gloo): the op, every layout, both backward
plans, P = 1..4, fp32 and bf16, against single-device dense attention with the same mask.  Each
multi-rank task runs a whole grid of cases inside one worker call (the groups' start-up dominates).
"""
from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from burstc import layout as layouts
from burstc.attention_ir import Alibi, FlexMask, FlexScore, MaskSpec, SlidingWindow, SoftCap
from burstc.block_geometry import ANTI_CAUSAL, CAUSAL, FULL, POSITIONS, Block, blocks, check_executable
from burstc.kernels.attention_blocks import reference_block_forward
from burstc.kernels.masked_attention_blocks import masked_block_backward, masked_block_forward
from burstc.ops import ring_attention as ra
from burstc.planner import predicted_work
from burstc.testing import tolerance

CAUSAL_SPEC = MaskSpec.causal()


def _window_masks(seq_len: int, local_len: int) -> dict[str, MaskSpec]:
    """Windows of every kind the geometry must handle, for a sequence of ``seq_len`` on shards of ``local_len``."""
    short = max(1, local_len // 2)
    return {
        "causal&window0": CAUSAL_SPEC & SlidingWindow(0),
        "causal&window_ge_S": CAUSAL_SPEC & SlidingWindow(seq_len),
        "causal&window_short": CAUSAL_SPEC & SlidingWindow(short),
        "causal&window_shard": CAUSAL_SPEC & SlidingWindow(local_len + 1),
        "two_sided": MaskSpec((SlidingWindow(short, 2),)),
        "two_sided0": MaskSpec((SlidingWindow(0, 0),)),
        "right_only": MaskSpec((SlidingWindow(None, 1),)),
        "causal&two_sided": CAUSAL_SPEC & SlidingWindow(3, 5),
    }


def _local_lens(layout):
    return (2, 4, 6) if layout == "zigzag" else (1, 2, 3, 5)


@pytest.fixture(params=[128, 3], ids=["tiles128", "tiles3"])
def window_tile_rows(request, monkeypatch):
    """The band's tile height: the default (tiles taller than these toy shards) and 3 (tiles split into shared,
    anti-causal and causal parts)."""
    from burstc import block_geometry

    monkeypatch.setattr(block_geometry, "WINDOW_TILE_ROWS", request.param)
    if request.param == 3:  # split even these toy tiles
        monkeypatch.setattr(block_geometry, "MERGE_SLACK_ENTRIES", 0)
    block_geometry._window_blocks.cache_clear()
    yield request.param
    block_geometry._window_blocks.cache_clear()


@pytest.mark.parametrize("layout", layouts.LAYOUTS)
@pytest.mark.parametrize("world_size", [1, 2, 3, 4])
def test_window_blocks_cover_exactly_the_visible_entries(layout, world_size, window_tile_rows):
    """Each visible entry is covered once, nothing hidden is (full/causal blocks), score_entries is the
    visible count, () exactly when nothing is visible, and the own pair's blocks cover every row."""
    for local_len in _local_lens(layout):
        seq_len = local_len * world_size
        positions = [layouts.local_positions(seq_len, world_size, r, layout) for r in range(world_size)]
        for name, mask in _window_masks(seq_len, local_len).items():
            for q_owner in range(world_size):
                for kv_owner in range(world_size):
                    context = (layout, name, world_size, local_len, q_owner, kv_owner)
                    visible = mask.visible(positions[q_owner], positions[kv_owner])
                    found = blocks(layout, mask, q_owner, kv_owner, local_len, world_size)
                    assert (found == ()) == (not bool(visible.any())), context
                    covered = torch.zeros(visible.shape, dtype=torch.int64)
                    for block in found:
                        rows, cols = block.q_stop - block.q_start, block.kv_stop - block.kv_start
                        assert rows > 0 and cols > 0, context
                        own = torch.ones(rows, cols, dtype=torch.int64)
                        if block.mask == CAUSAL:
                            own = own.tril()
                        elif block.mask == ANTI_CAUSAL:
                            own = own.triu()
                        elif block.mask == POSITIONS:
                            own = visible[block.q_rows, block.kv_rows].to(torch.int64)
                        covered[block.q_rows, block.kv_rows] += own
                        assert block.score_entries == int(own.sum()), (context, block)
                    assert torch.equal(covered, visible.to(torch.int64)), (context, found)
                    if q_owner == kv_owner:  # every row sees its diagonal
                        assert bool((covered.sum(1) > 0).all()), (context, found)


def test_windows_use_full_and_causal_blocks_where_the_geometry_allows():
    """A window covering the whole sequence is causal; a zero window on the diagonal is element-wise;
    contiguous neighbours' bands are element-wise where they must be and far shards are skipped."""
    for layout in layouts.LAYOUTS:
        for q_owner in range(4):
            for kv_owner in range(4):
                wide = blocks(layout, CAUSAL_SPEC & SlidingWindow(32), q_owner, kv_owner, 8, 4)
                assert wide == blocks(layout, CAUSAL_SPEC, q_owner, kv_owner, 8, 4), (layout, q_owner, kv_owner)
    assert blocks("contiguous", CAUSAL_SPEC & SlidingWindow(0), 1, 1, 8, 4) == (Block(0, 8, 0, 8, POSITIONS, 8),)
    # the band's edge in the neighbour: row 0 sees keys 6, 7, row 1 key 7 (anti-causal: the flash kernel reversed)
    assert blocks("contiguous", CAUSAL_SPEC & SlidingWindow(2), 2, 1, 8, 4) == (Block(0, 2, 6, 8, ANTI_CAUSAL),)
    assert blocks("contiguous", CAUSAL_SPEC & SlidingWindow(2), 2, 0, 8, 4) == ()
    # rows that see the same keys make a full block (flash), the band's edge rows a positions block
    assert blocks("contiguous", CAUSAL_SPEC & SlidingWindow(10), 1, 0, 8, 4) == (
        Block(0, 3, 0, 8), Block(3, 8, 1, 8, POSITIONS, 7 + 6 + 5 + 4 + 3))
    assert blocks("contiguous", MaskSpec((SlidingWindow(None, None),)), 2, 3, 8, 4) == (Block(0, 8, 0, 8, FULL),)


def test_full_and_causal_blocks_ignore_score_mods():
    modded = CAUSAL_SPEC & SoftCap(5.0) & Alibi((0.5, 0.25))
    for layout in layouts.LAYOUTS:
        for pair in [(0, 0), (0, 1), (1, 0)]:
            assert blocks(layout, modded, *pair, 4, 2) == blocks(layout, CAUSAL_SPEC, *pair, 4, 2)


# documents and key padding run from their data: tests/test_ring_runtime_masks.py
@pytest.mark.parametrize("mask", [MaskSpec((FlexMask("mask_0"),)), CAUSAL_SPEC & FlexScore("score_0")])
def test_runtime_masks_are_refused_with_a_clear_message(mask):
    assert not mask.ring_supported
    with pytest.raises(NotImplementedError, match="static masks only.*needs runtime data"):
        check_executable(mask)
    with pytest.raises(NotImplementedError, match="static masks only"):
        blocks("zigzag", mask, 0, 1, 4, 2)


def test_static_masks_are_ring_supported():
    for mask in [CAUSAL_SPEC & SlidingWindow(3), MaskSpec((SlidingWindow(2, 2),)), MaskSpec.full() & SoftCap(30.0),
                 CAUSAL_SPEC & SlidingWindow(4) & Alibi((0.5,)) & SoftCap(10.0)]:
        assert mask.ring_supported and check_executable(mask) is mask


# ---------------------------------------------------------------------------------------------
# The position-masked block kernels


def _dense_reference(q, k, v, q_pos, kv_pos, mask: MaskSpec, scale: float):
    """fp32 dense attention with the mask and score mods applied by hand: ``(out, lse, scores)``."""
    groups = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(groups, 1), v.repeat_interleave(groups, 1)
    scores = (q @ k.transpose(-1, -2)) * scale
    alibi, softcap = mask.term(Alibi), mask.term(SoftCap)
    if alibi is not None:
        scores = scores + torch.tensor(alibi.slopes).view(1, -1, 1, 1) * (kv_pos[None, :] - q_pos[:, None])
    if softcap is not None:
        scores = softcap.cap * torch.tanh(scores / softcap.cap)
    scores = scores.masked_fill(~mask.visible(q_pos, kv_pos), float("-inf"))
    lse = torch.logsumexp(scores, -1)
    finite = torch.where(torch.isfinite(lse), lse, 0)  # a row that sees nothing: out 0, no NaN in its gradient
    return torch.exp(scores - finite.unsqueeze(-1)) @ v, lse


KERNEL_MASKS = {
    "window": CAUSAL_SPEC & SlidingWindow(3),
    "two_sided&alibi": MaskSpec((SlidingWindow(2, 4),)) & Alibi((0.5, 0.25, 0.125, 0.0625)),
    "causal&softcap": CAUSAL_SPEC & SoftCap(2.0),
    "window&alibi&softcap": CAUSAL_SPEC & SlidingWindow(5) & Alibi((1.0, 0.5, 0.25, 0.125)) & SoftCap(3.0),
}


@pytest.mark.parametrize("name", sorted(KERNEL_MASKS))
@pytest.mark.parametrize("heads_kv", [4, 2])
def test_masked_kernels_match_dense_autograd(name, heads_kv, monkeypatch):
    """Forward and backward of one block at positions with gaps (a zigzag-like pair), against the
    dense reference's autograd; tiny row chunks so that the chunking and column narrowing are used."""
    monkeypatch.setattr("burstc.kernels.masked_attention_blocks._masked_row_chunk", lambda *a: 3)
    mask, scale = KERNEL_MASKS[name], 0.4
    generator = torch.Generator().manual_seed(7)
    q_pos = torch.tensor([0, 1, 2, 3, 12, 13, 14, 15])
    kv_pos = torch.tensor([2, 3, 4, 5, 8, 9, 10, 11, 12])
    q = torch.randn(2, 4, len(q_pos), 8, generator=generator, dtype=torch.float64)
    k, v = (torch.randn(2, heads_kv, len(kv_pos), 8, generator=generator, dtype=torch.float64) for _ in range(2))
    grad_out = torch.randn(q.shape, generator=generator, dtype=torch.float64)
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    out_ref, lse_ref = _dense_reference(*leaves, q_pos, kv_pos, mask, scale)
    seen = torch.isfinite(lse_ref)  # rows that see nothing have no gradient and lse -inf
    (out_ref * grad_out).sum().backward()
    out, lse = masked_block_forward(q, k, v, q_pos, kv_pos, mask, scale)
    torch.testing.assert_close(lse, lse_ref.detach())
    torch.testing.assert_close(out, out_ref.detach())
    # the backward takes the global statistics: here the block is the whole attention
    safe_lse = torch.where(seen, lse_ref, 0).detach()
    grads = masked_block_backward(grad_out, q, k, v, safe_lse, (out * grad_out).sum(-1), None,  # fp64 delta
                                  q_pos, kv_pos, mask, scale)
    for got, leaf in zip(grads, leaves):
        torch.testing.assert_close(got, leaf.grad)


def test_masked_kernel_on_a_causal_block_equals_the_reference_kernel():
    q, k, v = (torch.randn(1, 2, 6, 8) for _ in range(3))
    out, lse = masked_block_forward(q, k, v, torch.arange(6), torch.arange(6), CAUSAL_SPEC, 0.3)
    out_ref, lse_ref = reference_block_forward(q, k, v, True, 0.3)
    torch.testing.assert_close(out, out_ref)
    torch.testing.assert_close(lse, lse_ref)


def test_alibi_needs_one_slope_per_query_head():
    q = torch.randn(1, 3, 4, 8)
    with pytest.raises(ValueError, match="2 slopes for 3 query heads"):
        masked_block_forward(q, q, q, torch.arange(4), torch.arange(4), MaskSpec.full() & Alibi((0.5, 0.25)), 1.0)


# ---------------------------------------------------------------------------------------------
# The op on gloo worker groups

WORKER_RUN_TIMEOUT_S = 300
COMPARED = ("out", "lse", "dq", "dk", "dv")
HEADS_Q, HEADS_KV, HEAD_DIM = 4, 2, 8
SLOPES = (0.5, 0.25, 0.125, 0.0625)


def _op_masks(seq_len: int, local_len: int) -> dict[str, MaskSpec]:
    return {
        "causal&window_short": CAUSAL_SPEC & SlidingWindow(max(1, local_len // 2)),
        "causal&window0&softcap": CAUSAL_SPEC & SlidingWindow(0) & SoftCap(2.0),
        "two_sided&alibi": MaskSpec((SlidingWindow(local_len + 1, 2),)) & Alibi(SLOPES),
        "full&softcap": MaskSpec.full() & SoftCap(1.5),
        "causal&alibi&softcap": CAUSAL_SPEC & Alibi(SLOPES) & SoftCap(4.0),
        "causal&window_wide": CAUSAL_SPEC & SlidingWindow(seq_len) & Alibi(SLOPES),
    }


def _reference(q, k, v, grad_out, mask: MaskSpec, scale: float) -> dict:
    """Single-device fp32 attention: SDPA with a dense bool or additive float mask, soft-cap by hand."""
    q32, k32, v32 = (t.float().clone().requires_grad_() for t in (q, k, v))
    pos = torch.arange(q.shape[2])
    visible = mask.visible(pos, pos)
    if mask.term(SoftCap) is None:
        alibi = mask.term(Alibi)
        attn_mask = visible if alibi is None else torch.zeros(visible.shape).masked_fill(~visible, float("-inf")) + \
            torch.tensor(alibi.slopes).view(1, -1, 1, 1) * (pos[None, :] - pos[:, None])
        out = F.scaled_dot_product_attention(q32, k32, v32, attn_mask=attn_mask, scale=scale, enable_gqa=True)
        _, lse = _dense_reference(q32, k32, v32, pos, pos, mask, scale)
    else:
        out, lse = _dense_reference(q32, k32, v32, pos, pos, mask, scale)
    (out * grad_out.float()).sum().backward()
    return {"out": out.detach(), "lse": lse.detach(), "dq": q32.grad, "dk": k32.grad, "dv": v32.grad}


def _run_grid(rank, world_size, dtype, grid):
    """Worker task: every (layout, local_len, mask name, plan) of ``grid``; max errors and scales per case,
    and whether the forward work counter equals the planner's prediction."""
    results = []
    for index, (layout, local_len, name, plan) in enumerate(grid):
        seq_len = local_len * world_size
        mask = _op_masks(seq_len, local_len)[name]
        generator = torch.Generator().manual_seed(1000 + index)
        q, grad_out = (torch.randn(2, HEADS_Q, seq_len, HEAD_DIM, generator=generator).to(dtype) for _ in range(2))
        k, v = (torch.randn(2, HEADS_KV, seq_len, HEAD_DIM, generator=generator).to(dtype) for _ in range(2))
        reference = _reference(q, k, v, grad_out, mask, 0.3)
        shard = lambda t: layouts.shard(t, 2, world_size, rank, layout)  # noqa: E731
        q_l, k_l, v_l = (shard(t).requires_grad_() for t in (q, k, v))
        with ra.record_stats() as stats:
            out, lse = ra.ring_attention_with_lse(q_l, k_l, v_l, mask=mask, layout=layout, plan=plan, scale=0.3)
            (out.float() * shard(grad_out).float()).sum().backward()
        errors = {}
        for key, got in {"out": out, "lse": lse, "dq": q_l.grad, "dk": k_l.grad, "dv": v_l.grad}.items():
            want = shard(reference[key])
            diff = (got.float() - want).abs().max().item()
            errors[key] = (diff if math.isfinite(diff) else float("inf"), want.abs().max().item())
        work = stats.of("forward")[0].total_work
        predicted = predicted_work(layout, mask, seq_len, world_size).per_rank[rank] * 2 * HEADS_Q
        results.append(((layout, local_len, name, plan), errors, work == predicted))
    return results


def _grid(world_size: int):
    grid = []
    for layout in layouts.LAYOUTS:
        for j, local_len in enumerate((2, 6) if layout == "zigzag" else (3, 5)):  # odd sizes where allowed
            for i, name in enumerate(sorted(_op_masks(8, 4))):
                grid.append((layout, local_len, name, ra.PLANS[(i + j) % 2]))  # each plan on every mask
    return grid


@pytest.mark.multirank
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("world_size", [1, 2, 3, 4])
def test_ring_matches_dense_attention_with_static_masks(workers, world_size, dtype):
    """Every layout and mask, each plan on half of them (alternating), out/lse/dq/dk/dv within tolerance."""
    per_rank = workers.get(world_size).run(_run_grid, dtype, _grid(world_size))
    checked = 0
    for rank, results in enumerate(per_rank):
        for case, errors, work_matches in results:
            assert work_matches, (rank, case)
            for key in COMPARED:
                allowed = tolerance(dtype, f"attention_{key}")
                diff, scale = errors[key]
                assert diff <= allowed.atol + allowed.rtol * scale, (rank, case, key, diff, scale)
                checked += 1
    assert checked == world_size * len(_grid(world_size)) * len(COMPARED)


def _run_grid_tiled(rank, world_size, dtype, grid):
    """:func:`_run_grid` with windows' bands split into 3-row tiles (shared full block, anti-causal and causal
    edges): the own pair is then several blocks and the forward's merge starts empty."""
    from burstc import block_geometry

    saved = block_geometry.WINDOW_TILE_ROWS, block_geometry.MERGE_SLACK_ENTRIES
    block_geometry.WINDOW_TILE_ROWS, block_geometry.MERGE_SLACK_ENTRIES = 3, 0
    block_geometry._window_blocks.cache_clear()
    try:
        return _run_grid(rank, world_size, dtype, grid)
    finally:
        block_geometry.WINDOW_TILE_ROWS, block_geometry.MERGE_SLACK_ENTRIES = saved
        block_geometry._window_blocks.cache_clear()


@pytest.mark.multirank
@pytest.mark.parametrize("world_size", [1, 3])
def test_ring_with_tiled_window_bands_matches_dense_attention(workers, world_size):
    grid = [case for case in _grid(world_size) if "window" in case[2]]
    assert grid
    for rank, results in enumerate(workers.get(world_size).run(_run_grid_tiled, torch.float32, grid)):
        for case, errors, work_matches in results:
            assert work_matches, (rank, case)
            for key in COMPARED:
                allowed = tolerance(torch.float32, f"attention_{key}")
                diff, scale = errors[key]
                assert diff <= allowed.atol + allowed.rtol * scale, (rank, case, key, diff, scale)


def _compiled_matches_eager(rank, world_size, mask: MaskSpec):
    """Worker task: eager vs ``torch.compile(fullgraph=True)`` ring attention with ``mask`` (zigzag)."""
    generator = torch.Generator().manual_seed(5)
    q, k, v = (torch.randn(1, HEADS_Q, 4 * world_size, HEAD_DIM, generator=generator) for _ in range(3))

    def attention(q_, k_, v_):
        out, lse = ra.ring_attention_with_lse(q_, k_, v_, mask=mask, layout="zigzag", plan="burst")
        return out.square().sum() + lse.sum()

    results = []
    for fn in (attention, torch.compile(attention, backend="aot_eager", fullgraph=True)):
        leaves = [layouts.shard(t, 2, world_size, rank, "zigzag").requires_grad_() for t in (q, k, v)]
        loss = fn(*leaves)
        loss.backward()
        results.append([loss.detach()] + [t.grad for t in leaves])
    return max((a - b).abs().max().item() for a, b in zip(*results))


@pytest.mark.multirank
def test_torch_compile_fullgraph_with_a_window_and_score_mods(workers):
    mask = CAUSAL_SPEC & SlidingWindow(2) & Alibi(SLOPES) & SoftCap(3.0)
    assert max(workers.get(2).run(_compiled_matches_eager, mask)) <= 1e-5
