"""Triton kernels for the fused LM-head + cross-entropy (never writes [N, V] logits to memory).

- forward: one program per block of BLOCK_N tokens walks the vocabulary in BLOCK_V tiles; each tile of logits is a
  tl.dot over BLOCK_H slices of the hidden size (fp32 accumulator), reduced on the fly into an online max / sum-exp
  (log-sum-exp), the target logit and (label smoothing) the sum of logits. Writes lse and the per-token loss.
- backward: one program per (token block, vocab block) recomputes its logit tile, forms
  dlogits = (softmax - (1 - eps) onehot - eps / V) * scale_n * softcap'(x), rounds it to the input dtype (as eager
  autograd does) and atomically adds dlogits @ W into grad_hidden and dlogits^T @ h into grad_weight (and the
  column sums into grad_bias), all into fp32 buffers that the wrapper casts once at the end.

Numerics mirror eager ``F.cross_entropy(F.linear(h, W, b).float(), t)``: the logit tile is rounded to the input
dtype before the fp32 softmax, exactly like the model's bf16 matmul output; a logit scale s (Cohere's ``logits * s``,
Granite's ``logits / d``) multiplies the rounded tile and rounds again, and in the backward multiplies the rounded
dlogits by s and rounds again, as eager's scalar multiply does in both directions.

triton is imported guarded (the module imports without it; the kernels then cannot run). The Triton interpreter
(TRITON_INTERPRET=1, CPU tests) is chosen when a kernel is *decorated*, i.e. when this module is first imported:
set the variable before that. burstc/ops/linear_cross_entropy.py imports this module only on the first
impl="triton" call, and always from inside an opaque torch.library.custom_op, since Dynamo/FakeTensor cannot trace
the interpreter.
"""
from __future__ import annotations

import torch
from torch import Tensor

from burstc.kernels.linear_cross_entropy import PADDING_TARGET

__all__ = ["triton_available", "interpreter_enabled", "triton_lce_forward", "triton_lce_backward"]

try:  # guarded: the package must import on machines without triton
    import triton
    import triton.language as tl
    from triton.language.extra import libdevice
except ImportError:  # pragma: no cover - exercised only without triton
    triton = tl = libdevice = None


def _jit(fn):
    return triton.jit(fn) if triton is not None else fn


def triton_available() -> bool:
    return triton is not None


def interpreter_enabled() -> bool:
    if triton is None:
        return False
    from triton import knobs

    return bool(knobs.runtime.interpret)


# Mode the kernels below were decorated in (the interpreter reads TRITON_INTERPRET at decoration time).
_DECORATED_FOR_INTERPRETER = interpreter_enabled()


@_jit
def _tanh(x, USE_LIBDEVICE: tl.constexpr):
    if USE_LIBDEVICE:
        result = libdevice.tanh(x)
    else:  # the interpreter has no libdevice; an odd Taylor series near 0 avoids the 1 - e^{-2|x|} cancellation
        abs_x = tl.abs(x)
        e = tl.exp(-2.0 * abs_x)
        far = (1.0 - e) / (1.0 + e)
        far = tl.where(x < 0, -far, far)
        sq = x * x
        near = x * (1.0 + sq * (-1.0 / 3.0 + sq * (2.0 / 15.0 + sq * (-17.0 / 315.0))))
        result = tl.where(abs_x < 0.125, near, far)
    return result


@_jit
def _round_to(x, DTYPE: tl.constexpr, INTERPRETER_BF16: tl.constexpr):
    """fp32 -> DTYPE -> fp32 with round-to-nearest-even (the rounding of an eager matmul output)."""
    if INTERPRETER_BF16:  # the interpreter's fp32 -> bf16 cast truncates; round to nearest even on the bits
        bits = x.to(tl.uint32, bitcast=True)
        bits = (bits + (0x7FFF + ((bits >> 16) & 1))) & 0xFFFF0000
        result = bits.to(tl.float32, bitcast=True)
    else:
        result = x.to(DTYPE).to(tl.float32)
    return result


@_jit
def _scale_by(x, logit_factor, LOGIT_DIVIDES: tl.constexpr):
    """``x / d`` (correctly rounded: ``/`` on fp32 compiles to an approximate division on CUDA) or ``x * s``."""
    if LOGIT_DIVIDES:
        result = tl.math.div_rn(x, logit_factor)
    else:
        result = x * logit_factor
    return result


@_jit
def _logit_tile(
    hidden_ptr, weight_ptr, bias_ptr, offs_n, offs_v, mask_n, mask_v, hidden_size,
    stride_hidden_n, stride_hidden_h, stride_weight_v, stride_weight_h, softcap, logit_factor,
    HAS_BIAS: tl.constexpr, HAS_SOFTCAP: tl.constexpr, HAS_LOGIT_FACTOR: tl.constexpr, LOGIT_DIVIDES: tl.constexpr,
    USE_LIBDEVICE_TANH: tl.constexpr, DOT_PRECISION: tl.constexpr, INTERPRETER_BF16: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_V: tl.constexpr, BLOCK_H: tl.constexpr,
):
    """(logits, tanh) for a [BLOCK_N, BLOCK_V] tile: fp32 logits after input-dtype rounding, the logit scale or
    divisor (rounded to the input dtype again, as eager's ``logits * s`` or ``logits / d``) and softcap."""
    acc = tl.zeros([BLOCK_N, BLOCK_V], tl.float32)
    for h0 in range(0, hidden_size, BLOCK_H):
        offs_h = h0 + tl.arange(0, BLOCK_H)
        mask_h = offs_h < hidden_size
        hidden_tile = tl.load(
            hidden_ptr + offs_n[:, None] * stride_hidden_n + offs_h[None, :] * stride_hidden_h,
            mask=mask_n[:, None] & mask_h[None, :], other=0.0,
        )
        weight_tile_HV = tl.load(
            weight_ptr + offs_v[None, :] * stride_weight_v + offs_h[:, None] * stride_weight_h,
            mask=mask_v[None, :] & mask_h[:, None], other=0.0,
        )
        if INTERPRETER_BF16:
            # the interpreter's tl.dot runs np.matmul on the raw uint16 storage of bf16 tiles; fp32 copies give the
            # result of a bf16 MMA with fp32 accumulation (bf16 x bf16 products are exact in fp32)
            hidden_tile = hidden_tile.to(tl.float32)
            weight_tile_HV = weight_tile_HV.to(tl.float32)
        acc = tl.dot(hidden_tile, weight_tile_HV, acc, input_precision=DOT_PRECISION)
    if HAS_BIAS:
        acc += tl.load(bias_ptr + offs_v, mask=mask_v, other=0.0).to(tl.float32)[None, :]
    logits = _round_to(acc, hidden_ptr.dtype.element_ty, INTERPRETER_BF16)
    if HAS_LOGIT_FACTOR:
        logits = _round_to(
            _scale_by(logits, logit_factor, LOGIT_DIVIDES), hidden_ptr.dtype.element_ty, INTERPRETER_BF16
        )
    tanh = logits  # unused without softcap
    if HAS_SOFTCAP:
        tanh = _tanh(logits / softcap, USE_LIBDEVICE_TANH)
        logits = softcap * tanh
    return logits, tanh


@_jit
def _lce_forward_kernel(
    hidden_ptr, weight_ptr, bias_ptr, target_ptr, loss_ptr, lse_ptr,
    num_tokens, vocab, hidden_size,
    stride_hidden_n, stride_hidden_h, stride_weight_v, stride_weight_h,
    ignore_index, padding_index, label_smoothing, softcap, logit_factor,
    HAS_BIAS: tl.constexpr, HAS_SOFTCAP: tl.constexpr, HAS_SMOOTHING: tl.constexpr, HAS_LOGIT_FACTOR: tl.constexpr,
    LOGIT_DIVIDES: tl.constexpr,
    USE_LIBDEVICE_TANH: tl.constexpr, DOT_PRECISION: tl.constexpr, INTERPRETER_BF16: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_V: tl.constexpr, BLOCK_H: tl.constexpr,
):
    pid_n = tl.program_id(0)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_n = offs_n < num_tokens
    target = tl.load(target_ptr + offs_n, mask=mask_n, other=ignore_index)

    running_max = tl.full([BLOCK_N], float("-inf"), tl.float32)
    running_sumexp = tl.zeros([BLOCK_N], tl.float32)
    target_logit = tl.zeros([BLOCK_N], tl.float32)
    logit_sum = tl.zeros([BLOCK_N], tl.float32)
    for v0 in range(0, vocab, BLOCK_V):
        offs_v = v0 + tl.arange(0, BLOCK_V)
        mask_v = offs_v < vocab
        logits, _ = _logit_tile(
            hidden_ptr, weight_ptr, bias_ptr, offs_n, offs_v, mask_n, mask_v, hidden_size,
            stride_hidden_n, stride_hidden_h, stride_weight_v, stride_weight_h, softcap, logit_factor,
            HAS_BIAS, HAS_SOFTCAP, HAS_LOGIT_FACTOR, LOGIT_DIVIDES, USE_LIBDEVICE_TANH, DOT_PRECISION, INTERPRETER_BF16,
            BLOCK_N, BLOCK_V, BLOCK_H,
        )
        logits = tl.where(mask_v[None, :], logits, float("-inf"))
        new_max = tl.maximum(running_max, tl.max(logits, axis=1))
        running_sumexp = running_sumexp * tl.exp(running_max - new_max) + tl.sum(
            tl.exp(logits - new_max[:, None]), axis=1
        )
        running_max = new_max
        target_logit += tl.sum(tl.where(offs_v[None, :] == target[:, None], logits, 0.0), axis=1)
        if HAS_SMOOTHING:
            logit_sum += tl.sum(tl.where(mask_v[None, :], logits, 0.0), axis=1)

    log_sumexp = tl.log(running_sumexp)
    lse = running_max + log_sumexp
    # lse - z_t as log(sum exp(z - max)) + (max - z_t): no cancellation of two large numbers
    loss = log_sumexp + (1.0 - label_smoothing) * (running_max - target_logit)
    if HAS_SMOOTHING:
        loss += label_smoothing * (running_max - logit_sum / vocab)
    valid = mask_n & (target != ignore_index) & (target != padding_index)
    tl.store(lse_ptr + offs_n, lse, mask=mask_n)
    tl.store(loss_ptr + offs_n, tl.where(valid, loss, 0.0), mask=mask_n)


@_jit
def _lce_backward_kernel(
    hidden_ptr, weight_ptr, bias_ptr, target_ptr, lse_ptr, scale_ptr,
    grad_hidden_ptr, grad_weight_ptr, grad_bias_ptr,
    num_tokens, vocab, hidden_size,
    stride_hidden_n, stride_hidden_h, stride_weight_v, stride_weight_h,
    ignore_index, padding_index, label_smoothing, softcap, logit_factor,
    HAS_BIAS: tl.constexpr, HAS_SOFTCAP: tl.constexpr, HAS_SMOOTHING: tl.constexpr, HAS_LOGIT_FACTOR: tl.constexpr,
    LOGIT_DIVIDES: tl.constexpr,
    USE_LIBDEVICE_TANH: tl.constexpr, DOT_PRECISION: tl.constexpr, INTERPRETER_BF16: tl.constexpr,
    NEED_GRAD_HIDDEN: tl.constexpr, NEED_GRAD_WEIGHT: tl.constexpr, NEED_GRAD_BIAS: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_V: tl.constexpr, BLOCK_H: tl.constexpr,
):
    pid_n = tl.program_id(0)
    pid_v = tl.program_id(1)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_v = pid_v * BLOCK_V + tl.arange(0, BLOCK_V)
    mask_n = offs_n < num_tokens
    mask_v = offs_v < vocab
    logits, tanh = _logit_tile(
        hidden_ptr, weight_ptr, bias_ptr, offs_n, offs_v, mask_n, mask_v, hidden_size,
        stride_hidden_n, stride_hidden_h, stride_weight_v, stride_weight_h, softcap, logit_factor,
        HAS_BIAS, HAS_SOFTCAP, HAS_LOGIT_FACTOR, LOGIT_DIVIDES, USE_LIBDEVICE_TANH, DOT_PRECISION, INTERPRETER_BF16,
        BLOCK_N, BLOCK_V, BLOCK_H,
    )

    target = tl.load(target_ptr + offs_n, mask=mask_n, other=ignore_index)
    lse = tl.load(lse_ptr + offs_n, mask=mask_n, other=0.0)
    # every row is computed: an ignored row's dlogits are 0 x its softmax, NaN where that is (as in eager); a
    # padding row (not the user's: target padding_index) is zeroed outright, hidden states included
    live_n = mask_n & (target != padding_index)
    valid = live_n & (target != ignore_index)
    row_scale = tl.where(valid, tl.load(scale_ptr + offs_n, mask=mask_n, other=0.0), 0.0)
    is_target = offs_v[None, :] == target[:, None]
    dlogits = tl.exp(logits - lse[:, None]) - tl.where(is_target, 1.0 - label_smoothing, 0.0)
    if HAS_SMOOTHING:
        dlogits -= label_smoothing / vocab
    dlogits = dlogits * row_scale[:, None]
    if HAS_SOFTCAP:
        dlogits = dlogits * (1.0 - tanh * tanh)  # d(c tanh(x / c)) / dx
    dlogits = tl.where(mask_v[None, :] & live_n[:, None], dlogits, 0.0)
    # eager autograd rounds dlogits to the input dtype before its two matmuls; so do we. A logit scale's chain rule
    # (d(x * s) / dx, d(x / d) / dx) multiplies (divides) the rounded dlogits by s (d) in the input dtype: another
    # rounding, as in eager.
    dlogits_rounded = _round_to(dlogits, hidden_ptr.dtype.element_ty, INTERPRETER_BF16)
    if HAS_LOGIT_FACTOR:
        dlogits_rounded = _round_to(
            _scale_by(dlogits_rounded, logit_factor, LOGIT_DIVIDES), hidden_ptr.dtype.element_ty, INTERPRETER_BF16
        )
    if INTERPRETER_BF16:  # fp32 tiles holding bf16 values (see _logit_tile)
        dlogits_lowp = dlogits_rounded
    else:
        dlogits_lowp = dlogits_rounded.to(hidden_ptr.dtype.element_ty)

    if NEED_GRAD_BIAS:
        # from the fp32 dlogits (as the chunked CPU path), times the scale
        bias_tile = tl.sum(dlogits, axis=0)
        if HAS_LOGIT_FACTOR:
            bias_tile = _scale_by(bias_tile, logit_factor, LOGIT_DIVIDES)
        tl.atomic_add(grad_bias_ptr + offs_v, bias_tile, mask=mask_v)
    if NEED_GRAD_HIDDEN or NEED_GRAD_WEIGHT:
        for h0 in range(0, hidden_size, BLOCK_H):
            offs_h = h0 + tl.arange(0, BLOCK_H)
            mask_h = offs_h < hidden_size
            if NEED_GRAD_HIDDEN:
                weight_tile_VH = tl.load(
                    weight_ptr + offs_v[:, None] * stride_weight_v + offs_h[None, :] * stride_weight_h,
                    mask=mask_v[:, None] & mask_h[None, :], other=0.0,
                )
                if INTERPRETER_BF16:
                    weight_tile_VH = weight_tile_VH.to(tl.float32)
                grad_hidden_tile = tl.dot(dlogits_lowp, weight_tile_VH, input_precision=DOT_PRECISION)
                tl.atomic_add(
                    grad_hidden_ptr + offs_n[:, None] * hidden_size + offs_h[None, :], grad_hidden_tile,
                    mask=mask_n[:, None] & mask_h[None, :],
                )
            if NEED_GRAD_WEIGHT:
                hidden_tile = tl.load(
                    hidden_ptr + offs_n[:, None] * stride_hidden_n + offs_h[None, :] * stride_hidden_h,
                    mask=live_n[:, None] & mask_h[None, :], other=0.0,
                )
                if INTERPRETER_BF16:
                    hidden_tile = hidden_tile.to(tl.float32)
                grad_weight_tile = tl.dot(tl.trans(dlogits_lowp), hidden_tile, input_precision=DOT_PRECISION)
                tl.atomic_add(
                    grad_weight_ptr + offs_v[:, None] * hidden_size + offs_h[None, :], grad_weight_tile,
                    mask=mask_v[:, None] & mask_h[None, :],
                )


# ---------------------------------------------------------------------------------------------------------------------
# Python wrappers


def _check_launchable(tensor: Tensor) -> bool:
    """Raise a clear error when the kernels cannot run on ``tensor``; True when they run in the interpreter."""
    if triton is None:
        raise RuntimeError("burstc linear_cross_entropy impl='triton' needs the triton package")
    if tensor.dtype not in (torch.float32, torch.bfloat16, torch.float16):
        raise TypeError(f"burstc linear_cross_entropy impl='triton' supports fp32/bf16/fp16, got {tensor.dtype}")
    if tensor.device.type == "cpu" and not _DECORATED_FOR_INTERPRETER:
        raise RuntimeError(
            "burstc linear_cross_entropy impl='triton' on CPU tensors needs TRITON_INTERPRET=1 set before "
            "burstc.kernels.linear_cross_entropy_triton is first imported (the first impl='triton' call); "
            "use impl='torch' for the chunked CPU path"
        )
    return _DECORATED_FOR_INTERPRETER


def _launch_options(hidden_NH, weight_VH, label_smoothing, softcap, logit_scale, logit_divisor, ignore_index,
                    interpret):
    if interpret:  # small tiles: the interpreter runs numpy per program
        blocks = dict(BLOCK_N=16, BLOCK_V=32, BLOCK_H=32)
    else:  # GPU defaults (not tuned on hardware here): 64 x 128 logit tiles, 64-wide hidden slices
        blocks = dict(BLOCK_N=64, BLOCK_V=128, BLOCK_H=64 if hidden_NH.dtype != torch.float32 else 32, num_warps=8)
    return dict(
        num_tokens=hidden_NH.shape[0],
        vocab=weight_VH.shape[0],
        hidden_size=hidden_NH.shape[1],
        stride_hidden_n=hidden_NH.stride(0),
        stride_hidden_h=hidden_NH.stride(1),
        stride_weight_v=weight_VH.stride(0),
        stride_weight_h=weight_VH.stride(1),
        ignore_index=ignore_index,
        padding_index=PADDING_TARGET,
        label_smoothing=float(label_smoothing),
        softcap=float(softcap) if softcap is not None else 1.0,
        # the kernels' one runtime factor: the scale s, or the divisor d with LOGIT_DIVIDES
        logit_factor=float(next((f for f in (logit_scale, logit_divisor) if f is not None), 1.0)),
        HAS_SOFTCAP=softcap is not None,
        HAS_LOGIT_FACTOR=logit_scale is not None or logit_divisor is not None,
        LOGIT_DIVIDES=logit_divisor is not None,
        HAS_SMOOTHING=float(label_smoothing) != 0.0,
        USE_LIBDEVICE_TANH=not interpret,
        # fp32 inputs: IEEE fp32 products, like torch's default (no TF32) matmul
        DOT_PRECISION="ieee" if hidden_NH.dtype == torch.float32 else "tf32",
        INTERPRETER_BF16=interpret and hidden_NH.dtype == torch.bfloat16,
        **blocks,
    )


def triton_lce_forward(
    hidden_NH: Tensor,
    weight_VH: Tensor,
    target_N: Tensor,
    bias_V: Tensor | None,
    *,
    ignore_index: int = -100,
    label_smoothing: float = 0.0,
    softcap: float | None = None,
    logit_scale: float | None = None,
    logit_divisor: float | None = None,
) -> tuple[Tensor, Tensor]:
    """Per-token fp32 loss (0 at ignored tokens) and fp32 lse, [N] each."""
    interpret = _check_launchable(hidden_NH)
    num_tokens = hidden_NH.shape[0]
    loss_N = torch.empty(num_tokens, dtype=torch.float32, device=hidden_NH.device)
    lse_N = torch.empty(num_tokens, dtype=torch.float32, device=hidden_NH.device)
    if num_tokens == 0:
        return loss_N, lse_N
    options = _launch_options(
        hidden_NH, weight_VH, label_smoothing, softcap, logit_scale, logit_divisor, ignore_index, interpret)
    grid = (triton.cdiv(num_tokens, options["BLOCK_N"]),)
    _lce_forward_kernel[grid](
        hidden_NH, weight_VH, bias_V if bias_V is not None else hidden_NH, target_N.contiguous(), loss_N, lse_N,
        HAS_BIAS=bias_V is not None, **options,
    )
    return loss_N, lse_N


def triton_lce_backward(
    hidden_NH: Tensor,
    weight_VH: Tensor,
    target_N: Tensor,
    bias_V: Tensor | None,
    lse_N: Tensor,
    token_grad_scale_N: Tensor,
    *,
    ignore_index: int = -100,
    label_smoothing: float = 0.0,
    softcap: float | None = None,
    logit_scale: float | None = None,
    logit_divisor: float | None = None,
    need_grad_hidden: bool = True,
    need_grad_weight: bool = True,
    need_grad_bias: bool = True,
) -> tuple[Tensor | None, Tensor | None, Tensor | None]:
    """Gradients of sum_n scale_n * loss_n w.r.t. hidden, weight, bias (None where not needed)."""
    interpret = _check_launchable(hidden_NH)
    num_tokens, hidden_size = hidden_NH.shape
    vocab = weight_VH.shape[0]
    need_grad_bias = need_grad_bias and bias_V is not None
    device = hidden_NH.device
    # fp32 accumulators for the atomics; one rounding to the parameter dtype at the end
    grad_hidden_acc = torch.zeros(num_tokens, hidden_size, dtype=torch.float32, device=device) if need_grad_hidden else None
    grad_weight_acc = torch.zeros(vocab, hidden_size, dtype=torch.float32, device=device) if need_grad_weight else None
    grad_bias_acc = torch.zeros(vocab, dtype=torch.float32, device=device) if need_grad_bias else None
    if num_tokens > 0 and (need_grad_hidden or need_grad_weight or need_grad_bias):
        options = _launch_options(
            hidden_NH, weight_VH, label_smoothing, softcap, logit_scale, logit_divisor, ignore_index, interpret)
        grid = (triton.cdiv(num_tokens, options["BLOCK_N"]), triton.cdiv(vocab, options["BLOCK_V"]))
        unused = lse_N  # placeholder pointer, never dereferenced when the matching NEED_* flag is off
        _lce_backward_kernel[grid](
            hidden_NH, weight_VH, bias_V if bias_V is not None else hidden_NH, target_N.contiguous(),
            lse_N.contiguous(), token_grad_scale_N.to(torch.float32).contiguous(),
            grad_hidden_acc if grad_hidden_acc is not None else unused,
            grad_weight_acc if grad_weight_acc is not None else unused,
            grad_bias_acc if grad_bias_acc is not None else unused,
            HAS_BIAS=bias_V is not None,
            NEED_GRAD_HIDDEN=need_grad_hidden,
            NEED_GRAD_WEIGHT=need_grad_weight,
            NEED_GRAD_BIAS=need_grad_bias,
            **options,
        )
    return (
        None if grad_hidden_acc is None else grad_hidden_acc.to(hidden_NH.dtype),
        None if grad_weight_acc is None else grad_weight_acc.to(weight_VH.dtype),
        None if grad_bias_acc is None else grad_bias_acc.to(bias_V.dtype),
    )
