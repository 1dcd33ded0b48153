"""Sequence-parallel plumbing ops that the ``shard`` pass inserts.

All rank-dependence lives inside these ops at run time (each op asks its process group for the
rank), so the compiled graph is the same on every rank and a shared Inductor cache is safe.

- ``burstc::shard_seq``: this rank's tokens of a replicated tensor along ``dim`` (in the layout);
  backward scatters the local gradient into zeros (the other ranks hold the other positions, and
  the parameter-gradient all-reduce sums them).
- ``burstc::gather_seq``: all ranks' shards -> the full tensor in global order (for sharded graph
  outputs); backward takes this rank's slice of the (replicated) gradient.
- :func:`loss_all_reduce`: sum of the ranks' partial losses; backward is the identity (each rank's
  partial loss gets gradient 1, as in the single-device loss).
- :func:`grad_all_reduce`: identity forward; backward sums the gradient over the mesh.
- :func:`grad_share`: identity forward; backward divides the gradient by the number of ranks (a replicated graph
  under ``reduce_grads=False``: the ranks' gradients then sum to the whole, as a sharded graph's do).
"""
from __future__ import annotations

import functools

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
from torch import Tensor
from torch.distributed.distributed_c10d import _resolve_process_group

from burstc.errors import wait_for_peer
from burstc.layout import local_positions, resolve_layout
from burstc.ops.ring_comm import wait_timeout


def _positions(group_name: str, seq_len: int, layout: str, device, chunk_owners: Tensor | None = None) -> Tensor:
    group = _resolve_process_group(group_name)
    return local_positions(seq_len, dist.get_world_size(group), dist.get_rank(group),
                           resolve_layout(layout, chunk_owners, seq_len), device=device)


def _padded(x: Tensor, dim: int, padded_len: int, pad_value: float) -> Tensor:
    if padded_len <= x.shape[dim]:
        return x
    shape = list(x.shape)
    shape[dim] = padded_len - x.shape[dim]
    return torch.cat([x, x.new_full(shape, pad_value)], dim=dim)


@torch.library.custom_op("burstc::shard_seq", mutates_args=())
def shard_seq(x: Tensor, dim: int, group_name: str, layout: str, padded_len: int = -1,
              pad_value: float = 0.0, chunk_owners: Tensor | None = None) -> Tensor:
    """This rank's tokens of ``x`` along ``dim``; with ``padded_len`` > S, ``x`` is first padded at
    the end with ``pad_value`` (the shard pass pads only where that is exact: causal attention,
    ignored targets).  ``chunk_owners``: the call's chunks, for layout ``"documents"``."""
    x = _padded(x, dim, padded_len, pad_value)
    return x.index_select(dim, _positions(group_name, x.shape[dim], layout, x.device, chunk_owners))


@shard_seq.register_fake
def _(x, dim, group_name, layout, padded_len=-1, pad_value=0.0, chunk_owners=None):
    world = dist.get_world_size(_resolve_process_group(group_name))
    shape = list(x.shape)
    shape[dim] = max(shape[dim], padded_len) // world
    return x.new_empty(shape)


@torch.library.custom_op("burstc::unshard_seq_grad", mutates_args=())
def unshard_seq_grad(grad: Tensor, dim: int, full_len: int, group_name: str, layout: str,
                     padded_len: int = -1, chunk_owners: Tensor | None = None) -> Tensor:
    world = dist.get_world_size(_resolve_process_group(group_name))
    total = grad.shape[dim] * world
    shape = list(grad.shape)
    shape[dim] = total
    positions = _positions(group_name, total, layout, grad.device, chunk_owners)
    full = grad.new_zeros(shape).index_copy(dim, positions, grad)
    return full.narrow(dim, 0, full_len).contiguous()


@unshard_seq_grad.register_fake
def _(grad, dim, full_len, group_name, layout, padded_len=-1, chunk_owners=None):
    shape = list(grad.shape)
    shape[dim] = full_len
    return grad.new_empty(shape)


def _shard_setup(ctx, inputs, output):
    x, dim, group_name, layout, padded_len, _, chunk_owners = inputs
    ctx.args = (dim, x.shape[dim], group_name, layout, padded_len)
    ctx.save_for_backward(chunk_owners)
    ctx.differentiable = x.is_floating_point() or x.is_complex()


def _shard_backward(ctx, grad):
    if not ctx.differentiable:
        return None, None, None, None, None, None, None
    chunk_owners, = ctx.saved_tensors
    return torch.ops.burstc.unshard_seq_grad(grad, *ctx.args, chunk_owners), None, None, None, None, None, None


shard_seq.register_autograd(_shard_backward, setup_context=_shard_setup)


@torch.library.custom_op("burstc::gather_seq", mutates_args=())
def gather_seq(x: Tensor, dim: int, group_name: str, layout: str, true_len: int = -1,
               chunk_owners: Tensor | None = None) -> Tensor:
    """All ranks' shards -> the full tensor in global order (its first ``true_len`` positions)."""
    group = _resolve_process_group(group_name)
    world = dist.get_world_size(group)
    local = x.movedim(dim, 0).contiguous()
    chunks = [torch.empty_like(local) for _ in range(world)]
    wait_for_peer(dist.all_gather(chunks, local, group=group, async_op=True), wait_timeout(group_name),
                  f"burstc gather_seq: rank {dist.get_rank()} waited for the other ranks of its sequence group",
                  "Every rank of the mesh must call the compiled model, with the same batch")
    full_len = local.shape[0] * world
    layout = resolve_layout(layout, chunk_owners, full_len)
    positions = torch.cat([local_positions(full_len, world, r, layout, device=x.device) for r in range(world)])
    full = torch.empty((full_len,) + tuple(local.shape[1:]), dtype=x.dtype, device=x.device)
    full[positions] = torch.cat(chunks)
    if 0 <= true_len < full_len:
        full = full[:true_len]
    return full.movedim(0, dim).contiguous()


@gather_seq.register_fake
def _(x, dim, group_name, layout, true_len=-1, chunk_owners=None):
    world = dist.get_world_size(_resolve_process_group(group_name))
    shape = list(x.shape)
    shape[dim] = true_len if true_len >= 0 else shape[dim] * world
    return x.new_empty(shape)


def _gather_setup(ctx, inputs, output):
    x, dim, group_name, layout, _, chunk_owners = inputs
    world = dist.get_world_size(_resolve_process_group(group_name))
    ctx.args = (dim, group_name, layout, x.shape[dim] * world)
    ctx.save_for_backward(chunk_owners)


def _gather_backward(ctx, grad):
    dim, group_name, layout, padded_len = ctx.args
    chunk_owners, = ctx.saved_tensors
    return (torch.ops.burstc.shard_seq(grad.contiguous(), dim, group_name, layout, padded_len, 0.0, chunk_owners),
            None, None, None, None, None)


gather_seq.register_autograd(_gather_backward, setup_context=_gather_setup)


class _LossAllReduce(torch.autograd.Function):
    @staticmethod
    def forward(ctx, partial: Tensor, group_name: str) -> Tensor:
        return funcol.wait_tensor(funcol.all_reduce(partial, "sum", group_name))

    @staticmethod
    def backward(ctx, grad):
        return grad, None


class _GradTransform(torch.autograd.Function):
    """Identity forward; the backward applies ``transform`` to the gradient."""

    @staticmethod
    def forward(ctx, param: Tensor, transform) -> Tensor:
        ctx.transform = transform
        return param.view_as(param)

    @staticmethod
    def backward(ctx, grad):
        return ctx.transform(grad), None


def _summed_over(group_name: str, grad: Tensor) -> Tensor:
    return funcol.wait_tensor(funcol.all_reduce(grad.contiguous(), "sum", group_name))


def _divided_by(world_size: int, grad: Tensor) -> Tensor:
    return grad / world_size


def sum_all_reduce(partial: Tensor, group_name: str) -> Tensor:
    """Sum of the ranks' partial sums, used by sharded values: each rank's gradient is its tokens' part of the
    whole gradient, so the backward sums the parts over the ranks too (the all-reduce is its own adjoint): the
    loss all-reduce's forward over the gradient all-reduce's backward."""
    return loss_all_reduce(grad_all_reduce(partial, group_name), group_name)


def loss_all_reduce(partial: Tensor, group_name: str) -> Tensor:
    """Sum of the ranks' partial losses; each rank's partial gets gradient ``grad`` (identity)."""
    return _LossAllReduce.apply(partial, group_name)


def grad_all_reduce(param: Tensor, group_name: str) -> Tensor:
    """``param`` itself; its gradient is summed over the group in the backward."""
    return _GradTransform.apply(param, functools.partial(_summed_over, group_name))


def grad_share(param: Tensor, world_size: int) -> Tensor:
    """``param`` itself; its gradient is divided by ``world_size`` in the backward: each of ``world_size`` ranks
    that computed the whole gradient keeps its share, so summing the ranks' gradients gives the whole once."""
    return _GradTransform.apply(param, functools.partial(_divided_by, world_size))
