"""The peers' sequence-parallel causal attention on zigzag (head-tail) sharded ``[B, H, s, D]`` inputs, and the
bytes each sends per rank, by formula.

* :class:`TorchRing`: PyTorch's own ring (``_templated_ring_attention`` / ``_templated_ring_attention_backward``
  from ``torch.distributed.tensor.experimental._context_parallel._attention``) driven by the CPU flash ops, with
  its head-tail load balance and a chosen K/V rotation;
* :func:`allgather_kv_attention`: Llama-3-style context parallelism in plain torch: K/V all-gathered, each local
  chunk attends to its causal prefix, dK/dV reduce-scattered by autograd.
"""
from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F

from burstc import layout as layouts

aten = torch.ops.aten


class TorchRing(torch.autograd.Function):
    """``TorchRing.apply(q, k, v, group, rotate)``: causal attention by PyTorch's ring (``rotate``: a
    ``_RotateMethod``), head-tail load balance on."""

    @staticmethod
    def forward(ctx, q, k, v, group, rotate):
        from torch.distributed.tensor.experimental._context_parallel import _attention as cp

        with torch_cp_options(rotate):
            out, lse, *_ = cp._templated_ring_attention(
                group, 2, aten._scaled_dot_product_flash_attention_for_cpu, q, k, v, is_causal=True)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.group, ctx.rotate = group, rotate
        return out

    @staticmethod
    def backward(ctx, grad_out):
        from torch.distributed.tensor.experimental._context_parallel import _attention as cp

        q, k, v, out, lse = ctx.saved_tensors
        with torch_cp_options(ctx.rotate):
            dq, dk, dv, *_ = cp._templated_ring_attention_backward(
                ctx.group, 2, aten._scaled_dot_product_flash_attention_for_cpu_backward.default,
                grad_out=grad_out.contiguous(), grad_out_name="grad_out", query=q, key=k, value=v, out=out,
                logsumexp=lse, is_causal=True, dropout_p=0.0)
        return dq, dk, dv, None, None


class torch_cp_options:
    """Head-tail load balance on, the given K/V rotation; restores the previous options."""

    def __init__(self, rotate):
        from torch.distributed.tensor.experimental._context_parallel import _attention as cp

        self.cp, self.rotate = cp, rotate

    def __enter__(self):
        options = self.cp._cp_options
        self.saved = (options.enable_load_balance, options.rotate_method)
        options.enable_load_balance = True
        options.rotate_method = self.rotate

    def __exit__(self, *exc):
        self.cp._cp_options.enable_load_balance, self.cp._cp_options.rotate_method = self.saved


class _AllGatherSeq(torch.autograd.Function):
    """All-gather along the sequence (rank order); backward: reduce-scatter (sum) of the gradient."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        parts = [torch.empty_like(x) for _ in range(dist.get_world_size(group))]
        dist.all_gather(parts, x.contiguous(), group=group)
        return torch.cat(parts, dim=2)

    @staticmethod
    def backward(ctx, grad):
        chunks = [c.contiguous() for c in grad.chunk(dist.get_world_size(ctx.group), dim=2)]
        out = torch.empty_like(chunks[0])
        dist.reduce_scatter(out, chunks, group=ctx.group)
        return out, None


def allgather_kv_attention(q, k, v, group):
    """Causal attention of zigzag-sharded ``[B, H, s, D]`` q/k/v (Llama-3 style): K/V all-gathered (dK/dV
    reduce-scattered by autograd), each local chunk against its causal prefix."""
    world_size, rank = dist.get_world_size(group), dist.get_rank(group)
    local_len = q.shape[2]
    half, seq_len = local_len // 2, local_len * world_size
    inverse = torch.argsort(layouts.permutation(seq_len, world_size, "zigzag"))
    k_full, v_full = (_AllGatherSeq.apply(t, group).index_select(2, inverse) for t in (k, v))  # natural order
    outs = []
    for local_chunk, global_chunk in enumerate((rank, 2 * world_size - 1 - rank)):
        rows = slice(local_chunk * half, (local_chunk + 1) * half)
        prefix = (global_chunk + 1) * half  # keys this chunk can see: a prefix, causal in its last block
        mask = torch.ones(half, prefix, dtype=torch.bool).tril(prefix - half)
        outs.append(F.scaled_dot_product_attention(q[:, :, rows], k_full[:, :, :prefix], v_full[:, :, :prefix],
                                                   attn_mask=mask, enable_gqa=True))
    return torch.cat(outs, dim=2)


def peer_bytes(impl: str, *, world_size: int, seq_len: int, batch: int, heads_q: int, heads_kv: int, head_dim: int,
               element_size: int) -> tuple[int, int]:
    """(forward, backward) bytes each rank sends per attention call, from the peer's algorithm (``impl``: one of
    ``torch_ring``, ``torch_ring_allgather``, ``lucidrains_zigzag``, ``allgather_kv``, ``ulysses``)."""
    P, B, D, a = world_size, batch, head_dim, element_size
    s = seq_len // P
    kv = 2 * B * s * heads_kv * D * a          # one rank's K and V
    dkv_fp32 = 2 * B * s * heads_kv * D * 4
    q_bytes = B * s * heads_q * D * a
    if impl in ("torch_ring", "torch_ring_allgather"):
        # K,V to P-1 peers (ring or all-gather: the same bytes); dK,dV in fp32 (convert_to_f32)
        # rotated with all-to-all at each of the P steps
        return (P - 1) * kv, (P - 1) * kv + P * dkv_fp32
    if impl == "lucidrains_zigzag":
        return (P - 1) * (kv + 2 * 8), 0  # all-gather K, V (+ an int64 size each); no dK/dV exchange
    if impl == "allgather_kv":
        return (P - 1) * kv, (P - 1) * kv  # all-gather K,V; reduce-scatter dK,dV (activation dtype)
    if impl == "ulysses":
        share = (P - 1) / P  # all-to-all keeps 1/P at home
        return int(share * (2 * q_bytes + kv)), int(share * (2 * q_bytes + kv))  # q,k,v,out / dout,dq,dk,dv
    raise KeyError(impl)
