"""Runtime mask terms in the ring: documents and key padding, executed exactly from their data.

Single-process: the masked block kernel with per-batch document ids / key validity against fp64
single-device SDPA with the dense mask, the exact pair skip, the op's argument checks.  Multi-rank
(gloo): the op, every layout, both backward plans, P = 1..4, fp32 and bf16, against fp32
single-device SDPA with the dense bool mask of :meth:`MaskSpec.visible`.  Documents are drawn
anywhere (lengths 1 included, no divisibility), padding is right and left, and rows that see
nothing are in the grid: they must give what SDPA gives (out 0, zero gradients; lse -inf).
"""
from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from burstc import layout as layouts
from burstc.attention_ir import Documents, KeyPadding, MaskSpec, SlidingWindow
from burstc.block_geometry import blocks, check_executable
from burstc.kernels.masked_attention_blocks import masked_block_backward, masked_block_forward
from burstc.ops import ring_attention as ra
from burstc.ops.ring_loops import MaskData, _pair_blocks
from burstc.testing import tolerance

CAUSAL = MaskSpec.causal()
DOCS, PAD = Documents("doc_ids"), KeyPadding("attention_mask")
COMPARED = ("out", "lse", "dq", "dk", "dv")
HEADS_Q, HEADS_KV, HEAD_DIM, BATCH = 4, 2, 8, 3
WORKER_RUN_TIMEOUT_S = 300

MASKS = {
    "causal&docs": CAUSAL & DOCS,
    "causal&pad": CAUSAL & PAD,
    "causal&docs&pad": CAUSAL & DOCS & PAD,
    "causal&window&docs&pad": CAUSAL & SlidingWindow(2) & DOCS & PAD,
    "full&pad": MaskSpec((PAD,)),
    "two_sided&docs": MaskSpec((SlidingWindow(3, 1), DOCS)),
}


def mask_data(seq_len: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(doc_ids_BS int64, key_valid_BS bool)`` for BATCH rows: documents with random boundaries
    (lengths 1 included); row 0 right-padded, row 1 left-padded, row 2 ids reused out of order (the
    pair skip must not assume sorted ids) and padding only at the last key."""
    generator = torch.Generator().manual_seed(seed)
    starts_BS = torch.rand(BATCH, seq_len, generator=generator) < 0.35
    starts_BS[:, 0] = True
    doc_ids_BS = starts_BS.long().cumsum(1) - 1
    doc_ids_BS[2] = doc_ids_BS[2] % 2 * 7  # documents 0, 7, 0, 7, ...: the same id twice, apart
    pad = max(1, seq_len // 3)
    key_valid_BS = torch.ones(BATCH, seq_len, dtype=torch.bool)
    key_valid_BS[0, seq_len - pad:] = False
    key_valid_BS[1, :pad] = False
    key_valid_BS[2, -1] = False
    return doc_ids_BS, key_valid_BS


def _visible(mask: MaskSpec, q_pos, kv_pos, doc_ids_BS, key_valid_BS) -> torch.Tensor:
    """Dense bool ``[B, 1, Sq, Skv]`` from the IR's reference (broadcast over heads)."""
    visible = mask.visible(q_pos, kv_pos, q_docs=doc_ids_BS[:, q_pos], kv_docs=doc_ids_BS[:, kv_pos],
                           kv_valid=key_valid_BS[:, kv_pos])
    return visible.expand(doc_ids_BS.shape[0], len(q_pos), len(kv_pos)).unsqueeze(1)


def _sdpa_reference(q, k, v, grad_out, visible_B1SS, scale: float) -> dict:
    """Single-device SDPA with the dense bool mask (its fully masked rows: out 0, zero gradients),
    in q's dtype upcast to at least fp32; lse is the logsumexp of the masked scaled scores."""
    acc = torch.promote_types(q.dtype, torch.float32)
    leaves = [t.to(acc).clone().requires_grad_() for t in (q, k, v)]
    out = F.scaled_dot_product_attention(*leaves, attn_mask=visible_B1SS, scale=scale, enable_gqa=True)
    (out * grad_out.to(acc)).sum().backward()
    groups = q.shape[1] // k.shape[1]
    scores = (leaves[0] @ leaves[1].repeat_interleave(groups, 1).transpose(-1, -2)).detach() * scale
    lse = torch.logsumexp(scores.masked_fill(~visible_B1SS, float("-inf")), -1)
    return {"out": out.detach(), "lse": lse, "dq": leaves[0].grad, "dk": leaves[1].grad, "dv": leaves[2].grad}


def error_vs(got: torch.Tensor, want: torch.Tensor) -> tuple[float, float]:
    """``(max |got - want| over finite entries, max |want|)``; inf when the non-finite patterns
    differ (a NaN never passes unless the reference has it in the same place; -inf lse must match)."""
    got, want = got.double(), want.double()
    if not torch.equal(got.isnan(), want.isnan()) or not torch.equal(got.isinf(), want.isinf()) or \
            not torch.equal(got[got.isinf()], want[want.isinf()]):
        return float("inf"), 0.0
    finite = torch.isfinite(want)
    if not bool(finite.any()):
        return 0.0, 0.0
    return (got[finite] - want[finite]).abs().max().item(), want[finite].abs().max().item()


# ---------------------------------------------------------------------------------------------
# The masked block kernel with per-batch data


@pytest.mark.parametrize("name", sorted(MASKS))
def test_masked_kernel_with_runtime_data_matches_dense_sdpa(name, monkeypatch):
    """A block at positions with gaps (a zigzag-like pair), fp64, tiny row chunks: out, lse, dq, dk,
    dv against SDPA with the dense mask; rows that see nothing give lse -inf, out 0, zero grads."""
    monkeypatch.setattr("burstc.kernels.masked_attention_blocks._masked_row_chunk", lambda *a: 3)
    mask, scale = MASKS[name], 0.4
    doc_ids_BS, key_valid_BS = mask_data(16, seed=3)
    q_pos, kv_pos = torch.tensor([0, 1, 2, 3, 12, 13, 14, 15]), torch.tensor([0, 2, 3, 4, 5, 8, 9, 10, 11, 15])
    generator = torch.Generator().manual_seed(11)
    q, grad_out = (torch.randn(BATCH, 4, len(q_pos), 8, generator=generator, dtype=torch.float64) for _ in range(2))
    k, v = (torch.randn(BATCH, 2, len(kv_pos), 8, generator=generator, dtype=torch.float64) for _ in range(2))
    visible = _visible(mask, q_pos, kv_pos, doc_ids_BS, key_valid_BS)
    # every key of the block padding in one batch row: no row of it sees anything (bidirectional too)
    key_valid_BS[2, kv_pos] = False
    visible = _visible(mask, q_pos, kv_pos, doc_ids_BS, key_valid_BS) if mask.term(KeyPadding) else visible
    assert not bool(visible.any(-1).all()) or not mask.term(KeyPadding), "the case must hold rows that see nothing"
    want = _sdpa_reference(q, k, v, grad_out, visible, scale)
    data = {"doc_ids_BS": doc_ids_BS, "key_valid_BS": key_valid_BS}
    out, lse = masked_block_forward(q, k, v, q_pos, kv_pos, mask, scale, **data)
    delta = (out * grad_out).sum(-1)
    dq, dk, dv = masked_block_backward(grad_out, q, k, v, lse, delta, None, q_pos, kv_pos, mask, scale, **data)
    for key, got in {"out": out, "lse": lse, "dq": dq, "dk": dk, "dv": dv}.items():
        diff, _ = error_vs(got, want[key])
        assert diff <= 1e-10, (name, key, diff)


def test_masked_kernel_runtime_data_varies_with_the_batch_row():
    """The same q/k/v in two batch rows with different documents give different outputs."""
    q = torch.randn(1, 2, 6, 8).expand(2, 2, 6, 8)
    doc_ids_BS = torch.tensor([[0, 0, 0, 0, 0, 0], [0, 0, 0, 1, 1, 1]])
    pos = torch.arange(6)
    out, lse = masked_block_forward(q, q, q, pos, pos, CAUSAL & DOCS, 0.3, doc_ids_BS=doc_ids_BS)
    torch.testing.assert_close(out[0, :, :3], out[1, :, :3])
    assert (out[0, :, 3:] - out[1, :, 3:]).abs().max() > 1e-3


# ---------------------------------------------------------------------------------------------
# Geometry, pair skip, argument checks


def test_runtime_terms_are_executable_and_blocks_take_the_static_part():
    for mask in MASKS.values():
        assert mask.ring_supported and check_executable(mask) is mask
        with pytest.raises(NotImplementedError, match="static geometry"):
            blocks("zigzag", mask, 0, 1, 4, 2)
    assert (CAUSAL & SlidingWindow(2) & DOCS & PAD).static_part == CAUSAL & SlidingWindow(2)


@pytest.mark.parametrize("layout", ["zigzag", "contiguous", "striped"])
@pytest.mark.parametrize("world_size", [1, 3, 4])
def test_padding_splits_blocks_so_real_keys_keep_the_flash_kernels(layout, world_size):
    """Key padding without documents: a block's keys real in every batch row run the static (flash-style) kernels,
    keys real in some rows the position-masked one, keys padded everywhere nothing; together they cover each visible
    entry exactly once (summed over the batch), for left, right, mixed and scattered padding, causal and full."""
    from burstc.block_geometry import CAUSAL as CAUSAL_BLOCK, FULL, MAX_PADDING_SEGMENTS, data_blocks

    local_len = 12
    seq_len = local_len * world_size
    generator = torch.Generator().manual_seed(world_size)
    paddings = {"left": lambda v, n: v.__setitem__(slice(None, n), False),
                "right": lambda v, n: v.__setitem__(slice(seq_len - n, None), False)}
    for case in range(8):
        valid_BS = torch.ones(2, seq_len, dtype=torch.bool)
        for row in range(2):
            side = ("left", "right")[(case + row * (case // 4)) % 2]  # cases 4..7 mix the sides
            paddings[side](valid_BS[row], int(torch.randint(1, seq_len, (), generator=generator)))
        if case == 7:  # scattered: more runs than a block splits into
            valid_BS[:, ::2] = True
            valid_BS[:, 1::4] = False
        no_docs_BS = torch.zeros(2, seq_len, dtype=torch.long)  # the mask has no documents term
        for mask in (CAUSAL & PAD, MaskSpec((PAD,))):
            for q_owner in range(world_size):
                for kv_owner in range(world_size):
                    q_pos, kv_pos = (layouts.local_positions(seq_len, world_size, o, layout) for o in (q_owner, kv_owner))
                    truth_BQK = _visible(mask, q_pos, kv_pos, no_docs_BS, valid_BS)[:, 0].long()
                    covered_BQK = torch.zeros_like(truth_BQK)
                    for block in data_blocks(layout, mask, q_owner, kv_owner, local_len, world_size,
                                             key_valid_BS=valid_BS):
                        keys_real_BK = valid_BS[:, kv_pos[block.kv_rows]]
                        if block.mask in (FULL, CAUSAL_BLOCK):  # the static geometry of the block, top-left causal
                            rows, cols = block.q_stop - block.q_start, block.kv_stop - block.kv_start
                            shape_QK = (torch.arange(rows)[:, None] >= torch.arange(cols)[None, :]) if block.causal \
                                else torch.ones(rows, cols, dtype=torch.bool)
                            if block.data_free:
                                assert bool(keys_real_BK.all()), (case, block)
                            seen_BQK = shape_QK[None] & keys_real_BK[:, None, :]
                        else:
                            seen_BQK = _visible(mask, q_pos[block.q_rows], kv_pos[block.kv_rows], no_docs_BS,
                                                valid_BS)[:, 0]
                        covered_BQK[:, block.q_rows, block.kv_rows] += seen_BQK.long()
                    assert torch.equal(covered_BQK, truth_BQK), (layout, world_size, case, q_owner, kv_owner)
    # a left-padded batch: most entries leave the position-masked kernel
    valid_BS = torch.ones(2, 8192, dtype=torch.bool)
    valid_BS[0, :2048], valid_BS[1, :2867] = False, False
    found = [b for q in range(4) for kv in range(4)
             for b in data_blocks("zigzag", CAUSAL & PAD, q, kv, 2048, 4, key_valid_BS=valid_BS)]
    masked = sum(b.kernel_entries for b in found if not b.data_free)
    assert sum(b.kernel_entries for b in found if b.data_free) > 2 * masked > 0
    assert MAX_PADDING_SEGMENTS >= 3


class _Ring:
    def __init__(self, size):
        self.size = size


def test_pair_skip_is_exact_and_happens_where_the_data_hide_a_pair():
    """A pair is skipped only when nothing in it is visible for any batch row; documents aligned to
    contiguous shards skip every off-diagonal pair, and all-padding keys skip their pairs."""
    seq_len, world_size = 12, 3
    generator = torch.Generator().manual_seed(0)
    for layout in layouts.LAYOUTS:
        local_len = seq_len // world_size
        pos = [layouts.local_positions(seq_len, world_size, r, layout) for r in range(world_size)]
        for seed in range(6):
            doc_ids_BS = torch.randint(0, 3, (2, seq_len), generator=generator).sort(1).values
            key_valid_BS = torch.rand(2, seq_len, generator=generator) < 0.5
            data = MaskData(doc_ids_BS, key_valid_BS)
            for name, mask in MASKS.items():
                for q_owner in range(world_size):
                    for kv_owner in range(world_size):
                        found = _pair_blocks(layout, mask, q_owner, kv_owner, local_len, _Ring(world_size), data)
                        visible = _visible(mask, pos[q_owner], pos[kv_owner], doc_ids_BS, key_valid_BS).any(0)[0]
                        if not bool(visible.any()):
                            continue
                        static = blocks(layout, mask.static_part, q_owner, kv_owner, local_len, world_size)
                        if mask.term(Documents) is None and mask.term(KeyPadding) is None:
                            assert found == static  # sorted document ids trim the blocks, padding splits them
                        # every visible entry in exactly one block, inside the static blocks
                        cover, inside = (torch.zeros(local_len, local_len, dtype=torch.int64) for _ in range(2))
                        for block in found:
                            cover[block.q_rows, block.kv_rows] += 1
                        for block in static:
                            inside[block.q_rows, block.kv_rows] += 1
                        assert bool((cover[visible] == 1).all()) and int(cover.max()) <= 1, (layout, name)
                        assert bool((inside[cover > 0] == 1).all()), (layout, name)
    aligned = MaskData(torch.arange(seq_len).div(4, rounding_mode="floor").expand(2, seq_len), None)
    for q_owner in range(world_size):
        for kv_owner in range(world_size):
            found = _pair_blocks("contiguous", MaskSpec((DOCS,)), q_owner, kv_owner, 4, _Ring(world_size), aligned)
            assert (found == ()) == (q_owner != kv_owner)
    padded = MaskData(None, torch.arange(seq_len).expand(2, seq_len) < 8)  # rank 2's keys all padding
    assert _pair_blocks("contiguous", MaskSpec((PAD,)), 0, 2, 4, _Ring(3), padded) == ()
    assert _pair_blocks("contiguous", MaskSpec((PAD,)), 0, 1, 4, _Ring(3), padded) != ()


def test_runtime_data_arguments_are_checked():
    q = torch.randn(2, 2, 4, 8)
    with pytest.raises(ra.MissingMaskData, match="doc_ids= is given exactly when"):
        ra.ring_attention(q, q, q, mask=CAUSAL & DOCS)
    with pytest.raises(ValueError, match="key_valid= is given exactly when.*given"):
        ra.ring_attention(q, q, q, mask=CAUSAL, key_valid=torch.ones(2, 4, dtype=torch.bool))
    spec = CAUSAL & DOCS & PAD
    good_docs, good_valid = torch.zeros(2, 4, dtype=torch.long), torch.ones(2, 4, dtype=torch.bool)
    with pytest.raises(ValueError, match=r"doc_ids must be \[B, S_global\] = \[2, 4\]"):
        ra._mask_data(spec, good_docs[:, :3], good_valid, 2, 4, q.device)
    with pytest.raises(TypeError, match="key_valid must be bool"):
        ra._mask_data(spec, good_docs, good_valid.long(), 2, 4, q.device)
    with pytest.raises(TypeError, match="doc_ids must be integer"):
        ra._mask_data(spec, good_docs.float(), good_valid, 2, 4, q.device)
    assert ra._mask_data(spec, good_docs, good_valid, 2, 4, q.device) == MaskData(good_docs, good_valid)


# ---------------------------------------------------------------------------------------------
# The op on gloo worker groups


def _run_grid(rank, world_size, dtype, grid):
    """Worker task: per case ``(case, errors, forward work == visible entries of this rank's rows,
    backward work)``; the data are the whole sequence's on every rank, as the model's inputs are."""
    results = []
    for index, (layout, local_len, name, plan) in enumerate(grid):
        seq_len, mask = local_len * world_size, MASKS[name]
        doc_ids_BS, key_valid_BS = mask_data(seq_len, seed=100 + index)
        results.append(_one_case(rank, world_size, dtype, (layout, local_len, name, plan), mask, doc_ids_BS,
                                 key_valid_BS, seed=1000 + index))
    return results


def _one_case(rank, world_size, dtype, case, mask, doc_ids_BS, key_valid_BS, seed):
    layout, local_len, _, plan = case
    seq_len = local_len * world_size
    data = {"doc_ids": doc_ids_BS if mask.term(Documents) else None,
            "key_valid": key_valid_BS if mask.term(KeyPadding) else None}
    generator = torch.Generator().manual_seed(seed)
    q, grad_out = (torch.randn(BATCH, HEADS_Q, seq_len, HEAD_DIM, generator=generator).to(dtype) for _ in range(2))
    k, v = (torch.randn(BATCH, HEADS_KV, seq_len, HEAD_DIM, generator=generator).to(dtype) for _ in range(2))
    pos = torch.arange(seq_len)
    visible = _visible(mask, pos, pos, doc_ids_BS, key_valid_BS)
    reference = _sdpa_reference(q, k, v, grad_out, visible, 0.3)
    shard = lambda t: layouts.shard(t, 2, world_size, rank, layout)  # noqa: E731
    q_l, k_l, v_l = (shard(t).requires_grad_() for t in (q, k, v))
    with ra.record_stats() as stats:
        out, lse = ra.ring_attention_with_lse(q_l, k_l, v_l, mask=mask, layout=layout, plan=plan, scale=0.3, **data)
        (out.float() * shard(grad_out).float()).sum().backward()
    errors = {key: error_vs(got, shard(reference[key]))
              for key, got in {"out": out, "lse": lse, "dq": q_l.grad, "dk": k_l.grad, "dv": v_l.grad}.items()}
    own_rows = layouts.local_positions(seq_len, world_size, rank, layout)
    expected_work = int(visible[:, :, own_rows].sum()) * HEADS_Q
    return (case, errors, stats.of("forward")[0].total_work == expected_work,
            stats.of("backward")[0].total_work, int(visible.sum()) * HEADS_Q, bool((~visible.any(-1)).any()))


def _grid(world_size: int):
    grid = []
    for j, layout in enumerate(layouts.LAYOUTS):
        local_len = 4 if layout == "zigzag" else (3 if world_size > 1 else 5)  # odd where allowed
        for i, name in enumerate(sorted(MASKS)):
            grid.append((layout, local_len, name, ra.PLANS[(i + j) % 2]))  # each plan on every mask
    return grid


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("world_size", [1, 2, 3, 4])
def test_ring_matches_sdpa_with_documents_and_padding(workers, world_size, dtype):
    """Every layout and mask, each plan on half of them: out/lse/dq/dk/dv within tolerance, the same
    non-finite pattern as SDPA (lse -inf exactly where a row sees nothing, never NaN), exact work."""
    per_rank = workers.get(world_size).run(_run_grid, dtype, _grid(world_size))
    checked, rows_seeing_nothing = 0, False
    for case_index, case in enumerate(_grid(world_size)):
        backward_work = sum(results[case_index][3] for results in per_rank)
        assert backward_work == per_rank[0][case_index][4], case  # every visible entry once, over the ranks
    for rank, results in enumerate(per_rank):
        for case, errors, work_matches, _, _, empty_rows in results:
            assert work_matches, (rank, case)
            rows_seeing_nothing |= empty_rows
            for key in COMPARED:
                allowed = tolerance(dtype, f"attention_{key}")
                diff, scale = errors[key]
                assert math.isfinite(diff) and diff <= allowed.atol + allowed.rtol * scale, (rank, case, key, diff)
                checked += 1
    assert rows_seeing_nothing and checked == world_size * len(_grid(world_size)) * len(COMPARED)


def _compiled_matches_eager(rank, world_size):
    """Worker task: eager vs ``torch.compile(fullgraph=True)`` with documents and padding (zigzag)."""
    seq_len = 4 * world_size
    doc_ids_BS, key_valid_BS = mask_data(seq_len, seed=9)
    generator = torch.Generator().manual_seed(5)
    q, k, v = (torch.randn(BATCH, HEADS_Q, seq_len, HEAD_DIM, generator=generator) for _ in range(3))

    def attention(q_, k_, v_, docs, valid):
        out, lse = ra.ring_attention_with_lse(q_, k_, v_, mask=CAUSAL & DOCS & PAD, layout="zigzag", plan="burst",
                                              doc_ids=docs, key_valid=valid)
        return out.square().sum() + torch.where(lse.isinf(), 0, lse).sum()

    results = []
    for fn in (attention, torch.compile(attention, backend="aot_eager", fullgraph=True)):
        leaves = [layouts.shard(t, 2, world_size, rank, "zigzag").requires_grad_() for t in (q, k, v)]
        loss = fn(*leaves, doc_ids_BS, key_valid_BS)
        loss.backward()
        results.append([loss.detach()] + [t.grad for t in leaves])
    return max((a - b).abs().max().item() for a, b in zip(*results))


def test_torch_compile_fullgraph_with_documents_and_padding(workers):
    assert max(workers.get(2).run(_compiled_matches_eager)) <= 1e-5


def _explicit_case(rank, world_size, layout, mask_code, doc_ids_B1S, key_valid_B1S, plan):
    doc_ids, key_valid = (t.expand(BATCH, -1).contiguous() for t in (doc_ids_B1S, key_valid_B1S))
    local_len = doc_ids.shape[1] // world_size
    return _one_case(rank, world_size, torch.float32, (layout, local_len, mask_code, plan), MaskSpec.decode(mask_code),
                     doc_ids, key_valid, seed=5)


@pytest.mark.parametrize("plan", ra.PLANS)
def test_a_block_whose_keys_are_all_padding_is_not_computed(workers, plan):
    # fuzz seed 2028 case 332 (5 tokens on 4 ranks, padded to 8 by the layout): the layout's pads share the last
    # document id and are padding keys, so documents alone left a block of (pad query 7, pad key 5) while no key row
    # of that pair travelled: ranks 0 and 1 raised inside the ring and ranks 2 and 3 waited for them (a hang)
    doc_ids = torch.tensor([[0, 0, 1, 1, 2, 3, 3, 3]])
    key_valid = torch.tensor([[False, False, True, True, True, False, False, False]])
    mask = "causal&documents(position_ids)&key_padding(attention_mask)"
    for rank, (case, errors, work_matches, *_) in enumerate(
            workers.get(4).run(_explicit_case, "zigzag", mask, doc_ids, key_valid, plan)):
        assert work_matches, rank
        for key in COMPARED:
            allowed = tolerance(torch.float32, f"attention_{key}")
            diff, scale = errors[key]
            assert math.isfinite(diff) and diff <= allowed.atol + allowed.rtol * scale, (rank, key, diff)
