"""Hybrid ring attention on a nodes x ranks-per-node mesh: Ulysses all-to-all inside a node, the ring across nodes.

USP's and TransformerEngine's ``a2a+p2p``.  Inside a node, one all-to-all trades the sequence for heads: each
of the G ranks of node n then holds H/G of the heads (query and key/value heads alike) for all the node's
tokens.  For the ``zigzag`` and ``contiguous`` layouts the node's tokens, sorted, are exactly node n's shard of
the same layout over the N nodes (zigzag over P = N * G ranks puts chunks nG .. nG+G-1 and their mirrors on node
n: zigzag chunks n and 2N-1-n of a G times longer shard), so the ring across nodes is the flat ring of
:mod:`burstc.ops.ring_loops` over the lane group (the ranks with this local index on every node), with its
masks, plans and mask-aware rows unchanged.  Another all-to-all brings the output (and LSE) back to the
sequence shards.  The backward does the same around the ring's backward.

Per rank and call it sends ``(G - 1) / G`` of its q, k, v and output inside the node (the all-to-alls, not
overlapped with compute), and over the inter-node link the ring's N - 1 blocks of ``G * S/P`` tokens and H/G heads
(as many bytes as the double ring's lane blocks).  Needs Hq and Hkv divisible by G.  A per-head score mod
follows its heads: under ALiBi each rank's ring applies the slopes of the heads it holds.
"""
from __future__ import annotations

import dataclasses
import functools

import torch
import torch.distributed as dist
from torch import Tensor

from burstc import layout as layouts
from burstc.attention_ir import Alibi, MaskSpec
from burstc.ops.ring_comm import UlyssesRing

HYBRID_LAYOUTS = ("zigzag", "contiguous")


def hybrid_applies(layout: str, heads_q: int, heads_kv: int, per_node: int) -> str | None:
    """None when the hybrid runs these shapes, else why not."""
    if layout not in HYBRID_LAYOUTS:
        return f"layout {layout!r}: a node's tokens are not one shard of it over the nodes (hybrid: {HYBRID_LAYOUTS})"
    if heads_q % per_node or heads_kv % per_node:
        return f"{heads_q} query / {heads_kv} key-value heads do not divide over {per_node} ranks per node"
    return None


@functools.lru_cache(maxsize=64)
def _node_order(seq_len: int, nodes: int, per_node: int, node: int, layout: str) -> tuple[Tensor, Tensor]:
    """``(sort, unsort)``: index the node's tokens (its ranks' shards concatenated in rank order) into
    increasing global order, and back."""
    world_size = nodes * per_node
    gathered = torch.cat([layouts.local_positions(seq_len, world_size, node * per_node + local, layout)
                          for local in range(per_node)])
    sort = torch.argsort(gathered)
    expected = layouts.local_positions(seq_len, nodes, node, layout)
    if not torch.equal(gathered[sort], expected):
        raise AssertionError(f"layout {layout!r}: node {node}'s tokens are not its shard over {nodes} nodes")
    return sort, torch.argsort(sort)


def _to_heads(x: Tensor, ring: UlyssesRing, seq_len: int, layout: str) -> Tensor:
    """``[B, H, s, ...]`` sequence shard -> ``[B, H/G, G*s, ...]``: this rank's heads, the node's tokens sorted."""
    size = ring.per_node
    batch, heads, local_len, *rest = x.shape
    send = x.reshape(batch, size, heads // size, local_len, *rest).transpose(0, 1).contiguous()
    received = torch.empty_like(send)
    dist.all_to_all_single(received, send, group=ring.intra)
    # received[g]: rank g's tokens of our heads -> [B, H/G, G*s, ...] in rank order
    gathered = received.movedim(0, 2).reshape(batch, heads // size, size * local_len, *rest)
    sort, _ = _node_order(seq_len, ring.nodes, size, ring.node, layout)
    return gathered.index_select(2, sort.to(x.device)).contiguous()


def _to_sequence(x: Tensor, ring: UlyssesRing, seq_len: int, layout: str) -> Tensor:
    """The inverse of :func:`_to_heads`."""
    size = ring.per_node
    batch, heads_part, node_len, *rest = x.shape
    local_len = node_len // size
    _, unsort = _node_order(seq_len, ring.nodes, size, ring.node, layout)
    gathered = x.index_select(2, unsort.to(x.device))
    send = gathered.reshape(batch, heads_part, size, local_len, *rest).movedim(2, 0).contiguous()
    received = torch.empty_like(send)
    dist.all_to_all_single(received, send, group=ring.intra)
    return received.transpose(0, 1).reshape(batch, size * heads_part, local_len, *rest).contiguous()


def _mask_of_heads(mask: MaskSpec, ring: UlyssesRing, heads_q: int) -> MaskSpec:
    """``mask`` for this rank's heads in the node view: :func:`_to_heads` gives the rank with local index ``g``
    the ``g``-th block of ``H / G`` heads, so ALiBi keeps those heads' slopes (the other terms are the same for
    every head)."""
    alibi = mask.term(Alibi)
    if alibi is None:
        return mask
    part = heads_q // ring.per_node
    mine = Alibi(alibi.slopes[ring.local * part:(ring.local + 1) * part])
    return dataclasses.replace(mask, score_mods=tuple(mine if isinstance(m, Alibi) else m for m in mask.score_mods))


def ulysses_ring_forward(q_BHSD: Tensor, k_BHSD: Tensor, v_BHSD: Tensor, ring: UlyssesRing, layout: str,
                         mask: MaskSpec, scale: float, data) -> tuple[Tensor, Tensor]:
    from burstc.ops.ring_loops import ring_forward

    seq_len = q_BHSD.shape[2] * ring.size
    node_view = [_to_heads(t, ring, seq_len, layout) for t in (q_BHSD, k_BHSD, v_BHSD)]
    out, lse = ring_forward(*node_view, ring.inter, layout, _mask_of_heads(mask, ring, q_BHSD.shape[1]), scale, data)
    return _to_sequence(out, ring, seq_len, layout), _to_sequence(lse.unsqueeze(-1), ring, seq_len, layout)[..., 0]


def ulysses_ring_backward(plan: str, grad_out: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor,
                          grad_lse: Tensor | None, ring: UlyssesRing, layout: str, mask: MaskSpec, scale: float,
                          data) -> tuple[Tensor, Tensor, Tensor]:
    from burstc.ops.ring_loops import ring_backward

    seq_len = q.shape[2] * ring.size
    heads = functools.partial(_to_heads, ring=ring, seq_len=seq_len, layout=layout)
    lse_heads = lambda t: heads(t.unsqueeze(-1))[..., 0]  # noqa: E731
    grads = ring_backward(plan, heads(grad_out.to(q.dtype)), heads(q), heads(k), heads(v), heads(out), lse_heads(lse),
                          None if grad_lse is None else lse_heads(grad_lse), ring.inter, layout,
                          _mask_of_heads(mask, ring, q.shape[1]), scale, data)
    return tuple(_to_sequence(g, ring, seq_len, layout) for g in grads)
