"""Fused LM-head + cross-entropy on CPU (and any torch device): plain-torch reference and chunked kernel.

Notation: N tokens, H hidden size, V vocabulary size, C tokens per chunk.

Semantics (what the chunked kernel reproduces, i.e. eager ``F.cross_entropy(F.linear(h, W, b).float(), t)``):

- logits ``x = h @ W^T + b`` are computed by the matmul in the *input* dtype (so bf16 logits are rounded to bf16
  once, exactly like the eager model), then upcast to fp32;
- optional softcap ``z = c * tanh(x / c)`` in fp32;
- per-token loss ``lse(z) - (1 - eps) * z_t - eps * mean_v(z_v)`` (label smoothing as in F.cross_entropy), 0 at
  ignored tokens;
- gradient w.r.t. the logits ``(softmax(z) - (1 - eps) * onehot(t) - eps / V) * dloss * (1 - (z / c)^2)``, rounded
  to the input dtype before the two gradient matmuls (as eager autograd does); the weight gradient is summed over
  chunks in an fp32 accumulator and rounded to the weight dtype once at the end.

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

# Transient budget for one chunk's [C, V] buffers. 32 MiB keeps C >= 64 up to V = 128k in bf16 (bf16 matmuls on
# this CPU reach full speed from C ~ 128 at H = 256; at H >= 1024 C = 64 is enough) while staying ~1/40 of the
# eager logits at the benchmark shapes. Tuned with benchmarks/fused_loss.py.
TRANSIENT_BUDGET_BYTES = 32 * 2**20
# Rows per chunk are a multiple of this (matmul blocking), unless the whole input is smaller.
_CHUNK_ROW_MULTIPLE = 16
# Vocabulary rows per low-precision weight-gradient partial product (see _accumulate_weight_grad).
_WEIGHT_GRAD_PARTIAL_BYTES = 8 * 2**20


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
      logits in the input dtype (matmul output)          V * e   (shared with the fp32 buffer when e == 4)
      fp32 work buffer: logits -> exp -> dlogits          V * 4
      dlogits rounded to the input dtype (matmul input)  V * e   (none when e == 4)
      tanh(x / c) kept for the softcap derivative         V * 4   (softcap only)
    so C = budget / row_bytes, e.g. bf16, V = 32768: 8 B * 32768 = 256 KiB/row -> C = 128 (32 MiB);
    V = 65536 -> C = 64. The extra memory of the whole op is then
      C * row_bytes  +  V * H * 4 (fp32 weight-grad accumulator)  +  V * H * e (weight grad)  +  N * H * e,
    against N * V * (e + 4 + 4 + ...) bytes for eager logits/softmax/grad.
    ``hidden`` does not change the transient size; it only sets a floor of 16 rows, below which the [C, H] x [H, V]
    matmuls lose efficiency. ``num_tokens`` (when known) caps the chunk.
    """
    elem = torch.empty((), dtype=dtype).element_size()
    row_bytes = vocab * (4 + (2 * elem if elem != 4 else 0) + (4 if softcap else 0))
    rows = max(_CHUNK_ROW_MULTIPLE, TRANSIENT_BUDGET_BYTES // max(row_bytes, 1))
    rows -= rows % _CHUNK_ROW_MULTIPLE
    if isinstance(num_tokens, int) and num_tokens > 0:
        rows = min(rows, num_tokens)
    del hidden
    return int(rows)


def _accumulate_weight_grad(
    grad_weight_acc_VH: Tensor, dlogits_lowp_CV: Tensor, hidden_CH: Tensor, partial_buf: Tensor | None
) -> None:
    """grad_weight_acc_VH (fp32) += dlogits_CV^T @ hidden_CH.

    fp32 inputs: one addmm_ (fp32 accumulation throughout). Low-precision inputs: CPU has no bf16 x bf16 -> fp32
    matmul (aten::mm.dtype is CUDA-only) and an fp32 matmul is ~4x slower, so the chunk's partial product is
    computed by the bf16 matmul (fp32 accumulation over the C tokens inside the GEMM, one rounding of the partial)
    and added into the fp32 accumulator: chunks never accumulate in bf16, which is what makes naive chunking drift.
    The partial is produced vocabulary slice by vocabulary slice so its buffer stays small.
    """
    if partial_buf is None:
        grad_weight_acc_VH.addmm_(dlogits_lowp_CV.t(), hidden_CH)
        return
    vocab = dlogits_lowp_CV.shape[1]
    slice_rows = partial_buf.shape[0]
    for v0 in range(0, vocab, slice_rows):
        v1 = min(v0 + slice_rows, vocab)
        partial_SH = partial_buf[: v1 - v0]
        torch.mm(dlogits_lowp_CV[:, v0:v1].t(), hidden_CH, out=partial_SH)
        grad_weight_acc_VH[v0:v1].add_(partial_SH)


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
    chunk = max(1, min(int(chunk_size), num_tokens))
    hidden_NH = hidden_NH.contiguous()
    weight_t_HV = weight_VH.t()

    loss_out_N = torch.zeros(num_tokens, dtype=work_dtype, device=device)
    lse_out_N = torch.empty(num_tokens, dtype=work_dtype, device=device) if lse_N is None else lse_N
    grad_hidden_NH = torch.empty_like(hidden_NH) if need_grad_hidden else None
    grad_weight_acc_VH = torch.zeros(vocab, hidden_size, dtype=work_dtype, device=device) if need_grad_weight else None
    grad_bias_acc_V = torch.zeros(vocab, dtype=work_dtype, device=device) if need_grad_bias else None
    if num_tokens == 0:
        return _finish(loss_out_N, lse_out_N, grad_hidden_NH, grad_weight_acc_VH, grad_bias_acc_V, weight_VH, bias_V)

    # Per-chunk buffers, allocated once and reused: fresh [C, V] allocations are page-faulted on every chunk
    # (measured ~10x slower than writing into a warm buffer).
    work_CV = torch.empty(chunk, vocab, dtype=work_dtype, device=device)
    logits_lowp_CV = torch.empty(chunk, vocab, dtype=dtype, device=device) if low_precision else None
    dlogits_lowp_CV = torch.empty(chunk, vocab, dtype=dtype, device=device) if low_precision and with_grads else None
    tanh_CV = torch.empty(chunk, vocab, dtype=work_dtype, device=device) if softcap is not None else None
    partial_buf = None
    if need_grad_weight and low_precision:
        elem = hidden_NH.element_size()
        slice_rows = max(1, min(vocab, _WEIGHT_GRAD_PARTIAL_BYTES // (hidden_size * elem)))
        partial_buf = torch.empty(slice_rows, hidden_size, dtype=dtype, device=device)
    smoothing = float(label_smoothing)

    for start in range(0, num_tokens, chunk):
        stop = min(start + chunk, num_tokens)
        rows = stop - start
        hidden_CH = hidden_NH[start:stop]
        target_C = target_N[start:stop]
        valid_C = target_C != ignore_index
        safe_target_C1 = torch.where(valid_C, target_C, 0).unsqueeze(1)
        work = work_CV[:rows]

        # logits in the input dtype (bias fused into the GEMM like F.linear), then upcast into the fp32 buffer
        logits = logits_lowp_CV[:rows] if low_precision else work
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
            prob_scale_C = None
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
        dlogits = work
        if low_precision:
            dlogits = dlogits_lowp_CV[:rows]
            dlogits.copy_(work)  # eager autograd rounds dlogits to the input dtype before the matmuls too
        if need_grad_hidden:
            torch.mm(dlogits, weight_VH, out=grad_hidden_NH[start:stop])
        if need_grad_weight:
            _accumulate_weight_grad(grad_weight_acc_VH, dlogits, hidden_CH, partial_buf)
        if need_grad_bias:
            grad_bias_acc_V.add_(work.sum(dim=0))

    # drop the chunk buffers before the final casts allocate the low-precision gradients
    del work_CV, logits_lowp_CV, dlogits_lowp_CV, tanh_CV, partial_buf, work, logits, dlogits
    return _finish(loss_out_N, lse_out_N, grad_hidden_NH, grad_weight_acc_VH, grad_bias_acc_V, weight_VH, bias_V)


def _finish(loss_N, lse_N, grad_hidden_NH, grad_weight_acc_VH, grad_bias_acc_V, weight_VH, bias_V):
    grad_weight_VH = None if grad_weight_acc_VH is None else grad_weight_acc_VH.to(weight_VH.dtype)
    grad_bias_V = None if grad_bias_acc_V is None else grad_bias_acc_V.to(bias_V.dtype)
    return loss_N, lse_N, grad_hidden_NH, grad_weight_VH, grad_bias_V
