"""Fused LM-head + cross-entropy on CPU (and any torch device): plain-torch reference and chunked kernel.

Notation: N tokens, H hidden size, V vocabulary size, C tokens per chunk.

Semantics (what the chunked kernel reproduces, i.e. eager ``F.cross_entropy(F.linear(h, W, b).float(), t)``):

- logits ``x = h @ W^T + b`` are computed by the matmul in the *input* dtype (so bf16 logits are rounded to bf16
  once, exactly like the eager model), then upcast to fp32;
- optional softcap ``z = c * tanh(x / c)`` in fp32;
- per-token loss ``lse(z) - (1 - eps) * z_t - eps * mean_v(z_v)`` (label smoothing as in F.cross_entropy), 0 at
  ignored tokens;
- gradient w.r.t. the logits ``(softmax(z) - (1 - eps) * onehot(t) - eps / V) * dloss * (1 - (z / c)^2)`` in fp32;
  rounded to the input dtype for the hidden-gradient matmul (as eager autograd does: exact per chunk, since a
  token's row never spans chunks); the weight gradient is an fp32 GEMM of the fp32 dlogits accumulated over chunks
  in an fp32 accumulator and rounded to the weight dtype once at the end (no bf16 accumulation across chunks).

The chunked kernel never holds more than one chunk of logits: extra memory is O(C * V) plus the gradients.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

__all__ = [
    "linear_cross_entropy_reference",
    "default_chunk_size",
    "chunked_linear_cross_entropy",
    "TRANSIENT_BUDGET_BYTES",
]

# Transient budget for one chunk's [C, V] buffers: 24 MiB gives C = 128 at V = 32768 in bf16 (6 bytes per logit),
# where the bf16 matmuls on this CPU reach full speed (H = 256), and keeps the chunk well under the V x H fp32
# weight-gradient accumulator at the benchmark shapes. Tuned with benchmarks/fused_loss.py.
TRANSIENT_BUDGET_BYTES = 24 * 2**20
# Rows per chunk are a multiple of this (matmul blocking), unless the whole input is smaller.
_CHUNK_ROW_MULTIPLE = 16


def linear_cross_entropy_reference(
    hidden: Tensor,
    weight: Tensor,
    target: Tensor,
    bias: Tensor | None = None,
    *,
    ignore_index: int = -100,
    reduction: str = "mean",
    label_smoothing: float = 0.0,
    softcap: float | None = None,
    normalizer: Tensor | None = None,
    compute_dtype: torch.dtype = torch.float32,
) -> Tensor:
    """Oracle: materialize the full [N, V] logits and call F.cross_entropy.

    The matmul runs in the input dtype (as the model does); the logits are then upcast to ``compute_dtype``.
    fp32 gives eager semantics (``F.cross_entropy(F.linear(h, W, b).float(), t)``, autograd included). fp64 gives
    an exact oracle at the same rounded logits: the loss is evaluated in fp64 on the input-dtype logits, and the
    gradient flows straight through that rounding in fp64 (logits = rounded + (exact - exact.detach())), so the
    gradients reaching low-precision leaves are exact values rounded once. Pass fp64 inputs for fp64 logits.
    ``normalizer`` (mean/sum) divides the sum of per-token losses instead of the non-ignored count.
    """
    vocab = weight.shape[0]
    logits = F.linear(hidden, weight, bias)
    if compute_dtype == torch.float64 and logits.dtype != torch.float64:
        exact = F.linear(hidden.double(), weight.double(), None if bias is None else bias.double())
        logits = logits.detach().double() + (exact - exact.detach())
    logits = logits.to(compute_dtype).reshape(-1, vocab)
    if softcap is not None:
        logits = softcap * torch.tanh(logits / softcap)
    flat_target = target.reshape(-1)
    if normalizer is not None and reduction in ("mean", "sum"):
        per_token = F.cross_entropy(
            logits, flat_target, ignore_index=ignore_index, reduction="none", label_smoothing=label_smoothing
        )
        return per_token.sum() / normalizer.to(compute_dtype)
    loss = F.cross_entropy(
        logits, flat_target, ignore_index=ignore_index, reduction=reduction, label_smoothing=label_smoothing
    )
    return loss.reshape(target.shape) if reduction == "none" else loss


def default_chunk_size(
    num_tokens: int | None, vocab: int, hidden: int, dtype: torch.dtype, *, softcap: bool = False
) -> int:
    """Tokens per chunk so that one chunk's transient buffers stay within TRANSIENT_BUDGET_BYTES.

    Memory arithmetic per token row of a chunk (V = vocab, e = bytes of the input dtype):
      fp32 work buffer: logits -> exp -> dlogits                          V * 4
      input-dtype buffer: logits out of the matmul, later dlogits into   V * e   (none when e == 4: the matmul
        the hidden-gradient matmul (never live at the same time)                   writes the fp32 buffer)
      tanh(x / c) kept for the softcap derivative                         V * 4   (softcap only)
    so C = budget / row_bytes, e.g. bf16, V = 32768: 6 B * 32768 = 192 KiB/row -> C = 128 (24 MiB);
    V = 65536 -> C = 64; fp32, V = 32768 -> C = 192. The extra memory of the whole op is then
      C * row_bytes + V * H * 4 (fp32 weight-grad accumulator) + V * H * e (the weight gradient, cast at the
      end while the accumulator is alive) + N * H * e (the hidden gradient),
    against N * V * (2e + 12) bytes for eager (logits, fp32 upcast, log-softmax, fp32 and input-dtype grads).
    ``hidden`` does not change the transient size; it only sets a floor of 16 rows, below which the [C, H] x [H, V]
    matmuls lose efficiency. ``num_tokens`` (when known) caps the chunk.
    """
    elem = torch.empty((), dtype=dtype).element_size()
    row_bytes = vocab * (4 + (elem if elem != 4 else 0) + (4 if softcap else 0))
    rows = max(_CHUNK_ROW_MULTIPLE, TRANSIENT_BUDGET_BYTES // max(row_bytes, 1))
    rows -= rows % _CHUNK_ROW_MULTIPLE
    if isinstance(num_tokens, int) and num_tokens > 0:
        rows = min(rows, num_tokens)
    del hidden
    return int(rows)


def chunked_linear_cross_entropy(
    hidden_NH: Tensor,
    weight_VH: Tensor,
    target_N: Tensor,
    bias_V: Tensor | None = None,
    *,
    token_grad_scale_N: Tensor | None = None,
    lse_N: Tensor | None = None,
    ignore_index: int = -100,
    label_smoothing: float = 0.0,
    softcap: float | None = None,
    chunk_size: int | None = None,
    need_grad_hidden: bool = True,
    need_grad_weight: bool = True,
    need_grad_bias: bool = True,
) -> tuple[Tensor, Tensor, Tensor | None, Tensor | None, Tensor | None]:
    """Token-chunked linear + cross-entropy. Returns (loss_N, lse_N, grad_hidden, grad_weight, grad_bias).

    loss_N / lse_N are fp32 per-token losses (0 at ignored tokens) and log-sum-exps (of the softcapped logits).
    With ``token_grad_scale_N`` (fp32 [N], d total_loss / d loss_n) the gradients of ``sum_n scale_n * loss_n`` are
    computed in the same chunk loop (3 matmuls per chunk: logits, grad_hidden, grad_weight); otherwise they are None
    and only the logits matmul runs. ``lse_N`` (saved by an earlier forward) skips the max/sum reductions when
    recomputing for a backward; loss_N is then not recomputed and returned as zeros.
    """
    num_tokens, hidden_size = hidden_NH.shape
    vocab = weight_VH.shape[0]
    dtype, device = hidden_NH.dtype, hidden_NH.device
    low_precision = dtype != torch.float32 and dtype != torch.float64
    work_dtype = torch.float64 if dtype == torch.float64 else torch.float32
    with_grads = token_grad_scale_N is not None
    need_grad_hidden &= with_grads
    need_grad_weight &= with_grads
    need_grad_bias &= with_grads and bias_V is not None
    if chunk_size is None:
        chunk_size = default_chunk_size(num_tokens, vocab, hidden_size, dtype, softcap=softcap is not None)
    hidden_NH = hidden_NH.contiguous()

    loss_out_N = torch.zeros(num_tokens, dtype=work_dtype, device=device)
    lse_out_N = torch.empty(num_tokens, dtype=work_dtype, device=device) if lse_N is None else lse_N
    grad_hidden_NH = torch.empty_like(hidden_NH) if need_grad_hidden else None
    grad_weight_acc_VH = torch.zeros(vocab, hidden_size, dtype=work_dtype, device=device) if need_grad_weight else None
    grad_bias_acc_V = torch.zeros(vocab, dtype=work_dtype, device=device) if need_grad_bias else None
    if num_tokens > 0:  # the chunk buffers live in _chunk_loop's frame: freed before the casts in _finish
        _chunk_loop(
            hidden_NH, weight_VH, target_N, bias_V, token_grad_scale_N, lse_N,
            loss_out_N, lse_out_N, grad_hidden_NH, grad_weight_acc_VH, grad_bias_acc_V,
            ignore_index=ignore_index, smoothing=float(label_smoothing), softcap=softcap,
            chunk=max(1, min(int(chunk_size), num_tokens)),
        )
    return _finish(loss_out_N, lse_out_N, grad_hidden_NH, grad_weight_acc_VH, grad_bias_acc_V, weight_VH, bias_V)


def _chunk_loop(
    hidden_NH, weight_VH, target_N, bias_V, token_grad_scale_N, lse_N,
    loss_out_N, lse_out_N, grad_hidden_NH, grad_weight_acc_VH, grad_bias_acc_V,
    *, ignore_index, smoothing, softcap, chunk,
):
    """The chunk loop of chunked_linear_cross_entropy; writes into the *_out / grad_* tensors in place."""
    num_tokens, hidden_size = hidden_NH.shape
    vocab = weight_VH.shape[0]
    dtype, device = hidden_NH.dtype, hidden_NH.device
    work_dtype = loss_out_N.dtype
    low_precision = dtype != work_dtype
    with_grads = token_grad_scale_N is not None
    weight_t_HV = weight_VH.t()

    # Per-chunk buffers, allocated once and reused: fresh [C, V] allocations are page-faulted on every chunk
    # (measured ~10x slower than writing into a warm buffer).
    work_CV = torch.empty(chunk, vocab, dtype=work_dtype, device=device)
    # one input-dtype buffer serves both the logits matmul output and the hidden-gradient matmul input (dlogits):
    # the logits are consumed by the upcast before the dlogits are written
    lowp_CV = torch.empty(chunk, vocab, dtype=dtype, device=device) if low_precision else None
    tanh_CV = torch.empty(chunk, vocab, dtype=work_dtype, device=device) if softcap is not None else None
    # fp32 copy of the chunk's hidden rows for the fp32 weight-gradient matmul (C x H, small)
    hidden_work_CH = (
        torch.empty(chunk, hidden_size, dtype=work_dtype, device=device)
        if grad_weight_acc_VH is not None and low_precision else None
    )

    for start in range(0, num_tokens, chunk):
        stop = min(start + chunk, num_tokens)
        rows = stop - start
        hidden_CH = hidden_NH[start:stop]
        target_C = target_N[start:stop]
        valid_C = target_C != ignore_index
        safe_target_C1 = torch.where(valid_C, target_C, 0).unsqueeze(1)
        work = work_CV[:rows]

        # logits in the input dtype (bias fused into the GEMM like F.linear), then upcast into the fp32 buffer
        logits = lowp_CV[:rows] if low_precision else work
        if bias_V is None:
            torch.mm(hidden_CH, weight_t_HV, out=logits)
        else:
            torch.addmm(bias_V, hidden_CH, weight_t_HV, out=logits)
        if low_precision:
            work.copy_(logits)
        if softcap is not None:
            tanh = tanh_CV[:rows]
            torch.div(work, softcap, out=tanh).tanh_()
            torch.mul(tanh, softcap, out=work)

        if lse_N is None:
            max_C = work.amax(dim=1)
            target_logit_C = work.gather(1, safe_target_C1).squeeze(1)
            mean_logit_C = work.sum(dim=1) / vocab if smoothing else None
            work.sub_(max_C.unsqueeze(1)).exp_()
            sumexp_C = work.sum(dim=1)
            log_sumexp_C = sumexp_C.log()
            lse_out_N[start:stop] = max_C + log_sumexp_C
            # lse - z_t written as log(sum exp(z - max)) + (max - z_t): no cancellation between two large numbers
            loss_C = log_sumexp_C + (1.0 - smoothing) * (max_C - target_logit_C)
            if smoothing:
                loss_C = loss_C + smoothing * (max_C - mean_logit_C)
            loss_out_N[start:stop] = torch.where(valid_C, loss_C, 0.0)
        else:
            work.sub_(lse_N[start:stop].unsqueeze(1)).exp_()  # softmax directly
            sumexp_C = None

        if not with_grads:
            continue
        # dlogits = (softmax - (1 - eps) onehot - eps / V) * scale, scale = 0 at ignored tokens
        row_scale_C = torch.where(valid_C, token_grad_scale_N[start:stop].to(work_dtype), 0.0)
        prob_scale_C = row_scale_C / sumexp_C if sumexp_C is not None else row_scale_C
        work.mul_(prob_scale_C.unsqueeze(1))
        work.scatter_add_(1, safe_target_C1, (-(1.0 - smoothing) * row_scale_C).unsqueeze(1))
        if smoothing:
            work.sub_((smoothing / vocab) * row_scale_C.unsqueeze(1))
        if softcap is not None:
            # d(c tanh(x / c)) / dx = 1 - tanh^2
            tanh.mul_(tanh)
            torch.addcmul(work, work, tanh, value=-1.0, out=work)
        if grad_hidden_NH is not None:
            dlogits = work
            if low_precision:
                dlogits = lowp_CV[:rows]
                dlogits.copy_(work)  # eager autograd rounds dlogits to the input dtype before this matmul too
            torch.mm(dlogits, weight_VH, out=grad_hidden_NH[start:stop])
        if grad_weight_acc_VH is not None:
            # fp32 GEMM on the fp32 dlogits straight into the fp32 accumulator: no per-chunk rounding at all, one
            # rounding to the weight dtype at the end. CPU has no bf16 x bf16 -> fp32 GEMM (aten::mm.dtype is
            # CUDA-only); a bf16 GEMM per chunk plus an fp32 add measured no faster at C = 128 (the mixed-dtype
            # add of V x H per chunk is memory-bound) and rounds every chunk's partial product.
            hidden_work = hidden_CH
            if hidden_work_CH is not None:
                hidden_work = hidden_work_CH[:rows]
                hidden_work.copy_(hidden_CH)
            grad_weight_acc_VH.addmm_(work.t(), hidden_work)
        if grad_bias_acc_V is not None:
            grad_bias_acc_V.add_(work.sum(dim=0))


def _finish(loss_N, lse_N, grad_hidden_NH, grad_weight_acc_VH, grad_bias_acc_V, weight_VH, bias_V):
    grad_weight_VH = None if grad_weight_acc_VH is None else grad_weight_acc_VH.to(weight_VH.dtype)
    grad_bias_V = None if grad_bias_acc_V is None else grad_bias_acc_V.to(bias_V.dtype)
    return loss_N, lse_N, grad_hidden_NH, grad_weight_VH, grad_bias_V
