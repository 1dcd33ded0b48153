"""One ring-attention case on a rank, against single-device SDPA: shared by the multi-rank ring tests."""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from burstc import layout as layouts
from burstc.attention_ir import Alibi, Documents, KeyPadding, MaskSpec


def runtime_mask_data(mask: MaskSpec, batch: int, seq_len: int, seed: int, doc_start_probability: float) -> dict:
    """The ``doc_ids`` / ``key_valid`` arguments for ``mask`` (None where it lacks the term): documents starting
    at each token with ``doc_start_probability`` (and at 0), the last third of batch row 0 padding."""
    generator = torch.Generator().manual_seed(seed)
    starts = torch.rand(batch, seq_len, generator=generator) < doc_start_probability
    starts[:, 0] = True
    key_valid = torch.ones(batch, seq_len, dtype=torch.bool)
    key_valid[0, seq_len - max(1, seq_len // 3):] = False
    return {"doc_ids": starts.long().cumsum(1) if mask.term(Documents) else None,
            "key_valid": key_valid if mask.term(KeyPadding) else None}


def ring_attention_case(rank: int, world_size: int, mask: MaskSpec, layout: str, plan: str, seq_len: int,
                        shape: tuple[int, int, int, int], data: dict, seed: int, scale: float = 0.3, **ring_kwargs):
    """``(errors, stats)``: per output (``out``, ``dq``, ``dk``, ``dv``) the max |ring - reference| on this
    rank's shard and the reference's max |value| (inf for a non-finite difference), and the
    :class:`burstc.ops.ring_attention.RingStats` of the forward and backward.  ``shape``: (B, Hq, Hkv, D);
    ``data``: the ``doc_ids`` / ``key_valid`` arguments (None where the mask lacks the term);
    ``ring_kwargs``: more :func:`burstc.ops.ring_attention.ring_attention` arguments (``group_or_mesh``, ``ring``)."""
    from burstc.ops import ring_attention as ra

    batch, heads_q, heads_kv, head_dim = shape
    generator = torch.Generator().manual_seed(seed)
    q, grad_out = (torch.randn(batch, heads_q, seq_len, head_dim, generator=generator) for _ in range(2))
    k, v = (torch.randn(batch, heads_kv, seq_len, head_dim, generator=generator) for _ in range(2))
    pos = torch.arange(seq_len)
    doc_ids, key_valid = data.get("doc_ids"), data.get("key_valid")
    visible = mask.visible(pos, pos, q_docs=doc_ids, kv_docs=doc_ids, kv_valid=key_valid)
    visible = visible.expand(batch, seq_len, seq_len).unsqueeze(1)
    attn_mask = visible
    if mask.score_mods:  # ALiBi as SDPA's additive mask: slope_h * (j - i) where visible, -inf elsewhere
        alibi = mask.term(Alibi)
        if alibi is None or len(mask.score_mods) > 1:
            raise NotImplementedError(f"ring_attention_case: score mods other than ALiBi ({mask.score_mods})")
        bias_HSS = torch.tensor(alibi.slopes).view(-1, 1, 1) * (pos[None, :] - pos[:, None])
        attn_mask = torch.where(visible, bias_HSS, float("-inf"))
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    ref_out = F.scaled_dot_product_attention(*leaves, attn_mask=attn_mask, scale=scale, enable_gqa=True)
    (ref_out * grad_out).sum().backward()
    reference = {"out": ref_out.detach(), "dq": leaves[0].grad, "dk": leaves[1].grad, "dv": leaves[2].grad}
    shard = lambda t: layouts.shard(t, 2, world_size, rank, layout)  # noqa: E731
    q_l, k_l, v_l = (shard(t).requires_grad_() for t in (q, k, v))
    with ra.record_stats() as stats:
        out = ra.ring_attention(q_l, k_l, v_l, mask=mask, layout=layout, plan=plan, scale=scale, **data, **ring_kwargs)
        (out * shard(grad_out)).sum().backward()
    errors = {}
    for key, got in {"out": out, "dq": q_l.grad, "dk": k_l.grad, "dv": v_l.grad}.items():
        want = shard(reference[key])
        diff = (got - want).abs().max().item()
        errors[key] = (diff if math.isfinite(diff) else float("inf"), want.abs().max().item())
    return errors, stats
