"""Softmax statistics of ring attention: the LSE convention, the fp32 merge, delta and its stand-in output.

LSE convention (the same in every ring module): fp32, natural log of the *scaled* scores, shape
``[B, H, S]`` and contiguous.  :func:`lse_to_BHS` is the one place that converts a kernel's LSE to it.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

ACC_DTYPE = torch.float32  # accumulators (out, lse, dq, dk, dv, delta) and everything fp32 on the wire


def lse_to_BHS(lse: Tensor) -> Tensor:
    """The CPU flash kernel returns a natural-log LSE of the scaled scores as a ``[B, H, S]``
    view of a ``[B, S, H]`` buffer (strides ``(S*H, 1, H)``); make it fp32 ``[B, H, S]``
    contiguous, the convention of the ring (the kernel's backward accepts that layout)."""
    return lse.to(ACC_DTYPE).contiguous()


def merge_attention_block_(out_acc_BHSD: Tensor, lse_acc_BHS: Tensor, out_blk_BHSD: Tensor, lse_blk_BHS: Tensor) -> None:
    """In place, fp32: fold a block's normalized ``(out, lse)`` into the running ``(out, lse)``.

    The sigmoid form is the stable rewrite of ``new = logaddexp(lse, lse_blk); out = out *
    exp(lse - new) + out_blk * exp(lse_blk - new)``: nothing is exponentiated that can overflow,
    and a block row with ``lse_blk = -inf`` (all masked) leaves the row unchanged.
    """
    lse_blk = lse_blk_BHS.to(lse_acc_BHS.dtype)
    weight_blk = torch.sigmoid(lse_blk - lse_acc_BHS).unsqueeze(-1)
    out_acc_BHSD.sub_(weight_blk * (out_acc_BHSD - out_blk_BHSD.to(out_acc_BHSD.dtype)))
    lse_acc_BHS.sub_(F.logsigmoid(lse_acc_BHS - lse_blk))


def merge_attention_block_or_empty_(out_acc_BHSD: Tensor, lse_acc_BHS: Tensor, out_blk_BHSD: Tensor,
                                    lse_blk_BHS: Tensor) -> None:
    """:func:`merge_attention_block_` where the running rows may be empty too (``lse = -inf``, out
    0: the start of a merge under runtime masks, where no block need cover every row).  The
    sigmoid form gives NaN for ``-inf - -inf``, so empty sides are selected explicitly: an empty
    block leaves the row, an empty accumulator takes the block's row exactly."""
    lse_blk = lse_blk_BHS.to(lse_acc_BHS.dtype)
    empty_blk, empty_acc = lse_blk == float("-inf"), lse_acc_BHS == float("-inf")
    diff = torch.where(empty_blk, torch.full_like(lse_blk, float("-inf")), lse_blk - lse_acc_BHS)
    weight_blk = torch.sigmoid(diff).unsqueeze(-1)  # empty accumulator, finite block: +inf -> 1
    out_acc_BHSD.sub_(weight_blk * (out_acc_BHSD - out_blk_BHSD.to(out_acc_BHSD.dtype)))
    merged = lse_acc_BHS - F.logsigmoid(lse_acc_BHS - lse_blk)
    lse_acc_BHS.copy_(torch.where(empty_blk, lse_acc_BHS, torch.where(empty_acc, lse_blk, merged)))


def attention_delta(out_BHSD: Tensor, grad_out_BHSD: Tensor) -> Tensor:
    """``delta = rowsum(out * grad_out)`` in fp32, shape ``[B, H, S]``."""
    return (out_BHSD.to(ACC_DTYPE) * grad_out_BHSD.to(ACC_DTYPE)).sum(-1)


def stand_in_output(grad_out_BHSD: Tensor, delta_BHS: Tensor, delta_has_lse_grad: bool = True) -> Tensor | None:
    """An ``out`` for the CPU flash backward that only reproduces ``rowsum(out * grad_out) = delta``.

    The kernel uses ``out`` for nothing else (tests check it: perturbing out orthogonally to
    grad_out leaves all gradients unchanged), so ``grad_out * delta / rowsum(grad_out**2)``
    replaces the real output of a query block that lives on another rank, and only the fp32 row
    ``delta`` has to travel.  Exact up to fp32 rounding for fp32 inputs; in bf16/fp16 the stand-in
    is rounded like any output.  A row with ``grad_out = 0`` gets 0, which is right when ``delta =
    0`` there (no lse gradient); ``None`` if some such row has ``delta != 0`` (only an lse gradient
    can do that): no stand-in exists and the caller must use a kernel that takes delta.  Without an lse gradient
    (``delta_has_lse_grad`` False) such a row cannot exist (``delta = rowsum(out * 0) = 0``): the check, a read on
    the host that would synchronize a GPU at every block, is skipped.
    """
    grad_out = grad_out_BHSD.to(ACC_DTYPE)
    norm_sq = (grad_out * grad_out).sum(-1, keepdim=True)
    delta = delta_BHS.unsqueeze(-1)
    if delta_has_lse_grad and bool(((norm_sq == 0) & (delta != 0)).any()):
        return None
    ratio = torch.where(norm_sq > 0, delta / norm_sq, torch.zeros_like(norm_sq))
    return (grad_out * ratio).to(grad_out_BHSD.dtype)
