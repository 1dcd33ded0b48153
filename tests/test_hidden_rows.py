"""Eager's fully hidden query rows in the ring op (``hidden_rows="uniform"``, :mod:`burstc.ops.hidden_rows`).

A model that adds ``finfo.min`` to hidden scores (HF eager) gives a query row whose every key is hidden (left
padding) the uniform average of V over all keys, and autograd differentiates through the rounded-away scores.
A model that replaces the hidden scores (``masked_fill``) gets the same output and no gradient to q and k
through them (``hidden_rows="uniform_replaced"``).  The ring op must equal that, out and gradients, on every layout, both backward
plans, P = 1..4 (flat, double and hybrid rings), GQA, fp32 and bf16, against an fp64 eager reference that
adds ``finfo(float64).min`` exactly as the model does.  Rows that see keys are untouched (the ring's own)."""
from __future__ import annotations

import math

import pytest
import torch

from burstc import layout as layouts
from burstc.attention_ir import Alibi, Documents, KeyPadding, MaskSpec, SlidingWindow, SoftCap, fully_hidden_rows
from burstc.testing import tolerance

CAUSAL, DOCS, PAD = MaskSpec.causal(), Documents("doc_ids"), KeyPadding("attention_mask")
MASKS = {
    "causal&pad": CAUSAL & PAD,
    "causal&window&pad": CAUSAL & SlidingWindow(2) & PAD,
    "causal&docs&pad": CAUSAL & DOCS & PAD,
    "full&pad": MaskSpec((PAD,)),
    # Gemma-2's soft-cap (a small cap: most scores bent), and ALiBi under it: the per-entry score gradient
    "causal&pad&softcap": CAUSAL & PAD & SoftCap(0.7),
    "causal&docs&pad&alibi&softcap": CAUSAL & DOCS & PAD & Alibi((0.5, 0.25, 0.125, 0.0625)) & SoftCap(0.9),
}
BASE_MASKS = ("causal&pad", "causal&window&pad", "causal&docs&pad", "full&pad")
SOFT_CAPPED = ("causal&pad&softcap", "causal&docs&pad&alibi&softcap")
BATCH, HEADS_Q, HEADS_KV, HEAD_DIM, SCALE = 3, 4, 2, 8, 0.3


def _data(mask: MaskSpec, seq_len: int, seed: int) -> dict:
    """Row 0 left-padded (its first third: rows that see nothing under causal), row 1 all padding (every row
    hidden, bidirectional too), row 2 right-padded (a window over pads hides the last rows)."""
    generator = torch.Generator().manual_seed(seed)
    key_valid = torch.ones(BATCH, seq_len, dtype=torch.bool)
    key_valid[0, :max(1, seq_len // 3)] = False
    key_valid[1] = False
    key_valid[2, seq_len - max(1, seq_len // 3):] = False
    starts = torch.rand(BATCH, seq_len, generator=generator) < 0.3
    starts[:, 0] = True
    return {"doc_ids": starts.long().cumsum(1) if mask.term(Documents) else None, "key_valid": key_valid}


def eager_reference(q, k, v, grad_out, visible_BSS, scale: float, mode: str = "uniform",
                    mask: MaskSpec = CAUSAL) -> dict:
    """What HF's eager attention computes, in fp64: scores (ALiBi's bias, then the soft-cap, where ``mask`` has
    them) + finfo.min where hidden (``mode="uniform"``; or the scores replaced by it, ``masked_fill``:
    ``"uniform_replaced"``), softmax, @ v."""
    leaves = [t.double().clone().requires_grad_() for t in (q, k, v)]
    groups = q.shape[1] // k.shape[1]
    key, value = (t.repeat_interleave(groups, 1) for t in leaves[1:])
    fill = torch.zeros(visible_BSS.shape, dtype=torch.float64).masked_fill(~visible_BSS, torch.finfo(torch.float64).min)
    fill = fill.unsqueeze(1)
    scores = leaves[0] @ key.transpose(-1, -2) * scale
    pos = torch.arange(q.shape[2], dtype=torch.float64)
    if mask.term(Alibi) is not None:
        slopes = torch.tensor(mask.term(Alibi).slopes, dtype=torch.float64)
        scores = scores + slopes[:, None, None] * (pos[None, :] - pos[:, None])
    if mask.term(SoftCap) is not None:
        cap = mask.term(SoftCap).cap
        scores = cap * torch.tanh(scores / cap)
    if mode == "uniform":
        scores = scores + fill
    else:
        scores = scores.masked_fill(~visible_BSS.unsqueeze(1), torch.finfo(torch.float64).min)
    out = torch.softmax(scores, dim=-1) @ value
    (out * grad_out.double()).sum().backward()
    return {"out": out.detach(), "dq": leaves[0].grad, "dk": leaves[1].grad, "dv": leaves[2].grad}


def _mesh(world_size: int, ring: str):
    if ring == "flat":
        return None
    from torch.distributed.device_mesh import init_device_mesh

    return init_device_mesh("cpu", (2, world_size // 2), mesh_dim_names=("inter", "intra"))


def _run(rank, world_size, dtype, grid, soft_cap_chunk_entries=None):
    from burstc.ops import hidden_rows
    from burstc.ops import ring_attention as ra

    if soft_cap_chunk_entries is not None:  # many chunks of hidden-row slots in the soft-capped backward
        hidden_rows._SOFT_CAP_CHUNK_ENTRIES = soft_cap_chunk_entries

    results = []
    for index, (layout, local_len, name, plan, ring, mode) in enumerate(grid):
        seq_len, mask = local_len * world_size, MASKS[name]
        data = _data(mask, seq_len, seed=index)
        generator = torch.Generator().manual_seed(500 + index)
        q, grad_out = (torch.randn(BATCH, HEADS_Q, seq_len, HEAD_DIM, generator=generator).to(dtype) for _ in range(2))
        k, v = (torch.randn(BATCH, HEADS_KV, seq_len, HEAD_DIM, generator=generator).to(dtype) for _ in range(2))
        pos = torch.arange(seq_len)
        visible = mask.visible(pos, pos, q_docs=data["doc_ids"], kv_docs=data["doc_ids"], kv_valid=data["key_valid"])
        visible = visible.expand(BATCH, seq_len, seq_len)
        want = eager_reference(q, k, v, grad_out, visible, SCALE, mode, mask)
        shard = lambda t: layouts.shard(t, 2, world_size, rank, layout)  # noqa: E731
        q_l, k_l, v_l = (shard(t).requires_grad_() for t in (q, k, v))
        out = ra.ring_attention(q_l, k_l, v_l, mask=mask, layout=layout, plan=plan, scale=SCALE,
                                hidden_rows=mode, group_or_mesh=_mesh(world_size, ring),
                                ring="auto" if ring == "flat" else ring, **data)
        (out.float() * shard(grad_out).float()).sum().backward()
        got = {"out": out, "dq": q_l.grad, "dk": k_l.grad, "dv": v_l.grad}
        errors = {}
        for key, value in got.items():
            expected = shard(want[key])
            diff = (value.double() - expected).abs().max().item() if bool(torch.isfinite(value).all()) else math.inf
            errors[key] = (diff, expected.abs().max().item())
        hidden_here = bool(shard(~visible.any(-1)[:, None, :, None].expand(BATCH, 1, seq_len, 1)).any())
        results.append(((layout, local_len, name, plan, ring, mode), errors, hidden_here))
    return results


def _grid(world_size: int, rings=("flat",), masks=BASE_MASKS):
    grid = []
    for j, layout in enumerate(layouts.LAYOUTS):
        local_len = 4 if layout == "zigzag" else (3 if world_size > 1 else 5)
        for i, name in enumerate(sorted(masks)):
            for ring in rings:
                mode = ("uniform", "uniform_replaced")[(i // 2 + j) % 2]  # each mode on half the masks of a layout
                grid.append((layout, local_len, name, ("kv_ring", "burst")[(i + j) % 2], ring, mode))
    return grid


def _check(per_rank, grid, dtype):
    hidden_somewhere = False
    for rank, results in enumerate(per_rank):
        assert len(results) == len(grid)
        for case, errors, hidden_here in results:
            hidden_somewhere |= hidden_here
            for key, (diff, scale) in errors.items():
                allowed = tolerance(dtype, f"attention_{key}")
                assert diff <= allowed.atol + allowed.rtol * scale, (rank, case, key, diff, scale)
    assert hidden_somewhere


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("world_size", [1, 2, 3])
def test_uniform_hidden_rows_match_eager(workers, world_size, dtype):
    grid = _grid(world_size)
    _check(workers.get(world_size).run(_run, dtype, grid), grid, dtype)


@pytest.mark.parametrize("world_size", [2, 3])
def test_soft_capped_hidden_rows_match_eager(workers, world_size):
    """Gemma-2's soft-cap (with ALiBi under it too): every hidden row's (q, dO) reaches every rank, whose keys
    give their per-entry score gradients; fp32 and bf16 alternate over the grid."""
    grid = [g[:5] + ("uniform",) for g in _grid(world_size, masks=SOFT_CAPPED)]
    for dtype in (torch.float32, torch.bfloat16):
        part = grid[dtype == torch.bfloat16::2]
        # fp32 with one slot per chunk (the chunk loop), bf16 with the default chunks
        chunk_entries = 1 if dtype == torch.float32 else 1 << 22
        _check(workers.get(world_size).run(_run, dtype, part, chunk_entries), part, dtype)


def test_uniform_hidden_rows_on_two_level_rings(workers):
    """The double ring and the hybrid (all-to-all in a node) on a 2 x 2 mesh: the sums cross both levels."""
    grid = [g for g in _grid(4, rings=("double", "ulysses"), masks=(*BASE_MASKS, "causal&pad&softcap"))
            if g[2] in ("causal&pad", "causal&docs&pad", "causal&pad&softcap")
            and not (g[4] == "ulysses" and g[0] == "striped")]
    _check(workers.get(4).run(_run, torch.float32, grid), grid, torch.float32)


def test_zero_hidden_rows_stay_sdpa_and_uniform_needs_key_padding():
    from burstc.ops import ring_attention as ra

    q = torch.randn(1, 2, 4, 8)
    for mode in ("uniform", "uniform_replaced"):
        with pytest.raises(ValueError, match="needs a KeyPadding term"):
            ra.ring_attention(q, q, q, mask=CAUSAL, hidden_rows=mode)
    with pytest.raises(ValueError, match="hidden_rows must be one of"):
        ra.ring_attention(q, q, q, mask=CAUSAL, hidden_rows="mean")


def test_fully_hidden_rows_per_row_agree_with_dense_visibility():
    generator = torch.Generator().manual_seed(0)
    for name, mask in MASKS.items():
        for seed in range(5):
            data = _data(mask, 11, seed)
            data["key_valid"] &= torch.rand(BATCH, 11, generator=generator) < 0.7
            pos = torch.arange(11)
            visible = mask.visible(pos, pos, q_docs=data["doc_ids"], kv_docs=data["doc_ids"],
                                   kv_valid=data["key_valid"]).expand(BATCH, 11, 11)
            got = fully_hidden_rows(mask, doc_ids_BS=data["doc_ids"], key_valid_BS=data["key_valid"])
            assert torch.equal(got, ~visible.any(-1)), (name, seed)
    assert fully_hidden_rows(CAUSAL, key_valid_BS=torch.zeros(1, 4, dtype=torch.bool)) is None


# -- detection: which fill a model hides scores with, and the mode the ring op mirrors it by ------------------------

SEQ, DIM = 12, 8


def _padded_attention(fill_kind: str):
    """A manual attention over a causal & key-padding mask built from ``attention_mask`` at run time."""
    def attention(q, k, v, attention_mask):
        scores = q @ k.transpose(-2, -1) * DIM ** -0.5
        i = torch.arange(SEQ)
        visible = (i[None, :] <= i[:, None])[None, None] & attention_mask.bool()[:, None, None, :]
        low = torch.finfo(scores.dtype).min
        if fill_kind == "added":
            scores = scores + torch.where(visible, 0.0, low).to(scores.dtype)
        elif fill_kind == "added_neg_inf":
            scores = scores + torch.where(visible, 0.0, float("-inf")).to(scores.dtype)
        elif fill_kind == "added_mixed":  # causal hides with -inf, padding with finfo.min
            padding = torch.where(attention_mask.bool(), 0.0, low)[:, None, None, :]
            scores = scores + torch.where(i[None, :] <= i[:, None], padding, float("-inf"))
        elif fill_kind == "replaced":
            scores = scores.masked_fill(~visible, low)
        elif fill_kind == "softcapped":
            scores = torch.tanh(scores / 5.0) * 5.0 + torch.where(visible, 0.0, low).to(scores.dtype)
        return torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype) @ v
    return attention


@pytest.mark.parametrize("fill_kind, dtype, expected", [
    ("added", torch.float32, "uniform"),
    ("added", torch.bfloat16, "uniform"),
    ("added", torch.float16, None),        # fp16's finfo.min (-65504) does not absorb a score of 20
    ("added_neg_inf", torch.float32, None),  # eager gives NaN rows: those calls run unsharded
    ("added_mixed", torch.float32, None),    # a hidden row's keys hidden by two fills: not uniform over all
    ("replaced", torch.float32, "uniform_replaced"),
    ("softcapped", torch.float32, "uniform"),  # the soft-cap's per-entry gradient: from every hidden row
])
def test_the_fill_a_model_hides_scores_with_picks_the_mode(fill_kind, dtype, expected):
    from burstc.testing.graphs import detect_attention_in

    generator = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 2, SEQ, DIM, generator=generator).to(dtype) for _ in range(3))
    attention_mask = torch.ones(2, SEQ, dtype=torch.long)
    attention_mask[0, :4] = 0
    _, context, _ = detect_attention_in(_padded_attention(fill_kind), q, k, v, attention_mask)
    (match,) = context.facts.attention.values()
    assert match.refusal is None and match.float_fill, match
    assert match.mask.term(KeyPadding) is not None, match.mask
    assert match.hidden_rows == expected, (match.hidden_fill, match.fill_replaces, match.mask)
