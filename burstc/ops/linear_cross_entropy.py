"""Fused linear + cross-entropy as torch.library custom ops (never materializes [tokens, vocab] logits or their grad).

Public entry point: :func:`linear_cross_entropy`. Custom ops (namespace ``burstc``):

- ``burstc::linear_cross_entropy_with_grads`` (mean/sum while training): returns the reduced loss together with the
  gradients of that loss, computed in the forward chunk loop (Liger-style: 3 matmuls per chunk, no backward
  recompute). Its autograd formula only scales the saved gradients by grad_output.
- ``burstc::linear_cross_entropy_forward``: per-token losses + lse (forward-only use, and reduction="none"). Its
  autograd formula calls
- ``burstc::linear_cross_entropy_backward``: recomputes logit chunks from (hidden, weight) and returns gradients
  of sum_n grad_loss_n * loss_n (the Triton kernel reuses the saved lse; the CPU path recomputes it with the
  fused softmax, which is cheaper there than exp(z - lse)).

The plain ``_*_impl`` functions are the ops' bodies (tests call them under a dispatch mode to see every
allocation). All three ops are opaque to Dynamo/AOTAutograd (FakeTensor kernels give shapes), so they trace under
``torch.compile(fullgraph=True)`` and also hide Triton-interpreter kernels, which cannot be traced.

Longer than ~400 lines because the three ops share their argument checks, autograd wiring and device dispatch
(chunked torch / Triton): one op family, registered together.
"""
from __future__ import annotations

import importlib.util
import math

import torch
from torch import Tensor

from burstc.ops.autocast import cast_like_lower_precision, without_autocast
from burstc.kernels.linear_cross_entropy import PADDING_TARGET, chunked_linear_cross_entropy, default_chunk_size

__all__ = ["linear_cross_entropy", "REDUCTIONS", "IMPLS", "PADDING_TARGET"]

REDUCTIONS = ("mean", "sum", "none")
IMPLS = ("auto", "torch", "triton")
_SUPPORTED_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64)
_TRITON_INSTALLED = importlib.util.find_spec("triton") is not None


def _loss_dtype(dtype: torch.dtype) -> torch.dtype:
    # fp32 whatever the input dtype (fp64 inputs keep fp64 so the op can be gradchecked)
    return torch.float64 if dtype == torch.float64 else torch.float32


def _empty_grad(like: Tensor, needed: bool, shape) -> Tensor:
    """Contiguous fresh tensor of ``shape`` (or [0] when that gradient is not computed)."""
    return torch.empty(shape if needed else (0,), dtype=like.dtype, device=like.device)


def _grads_or_empty(hidden, weight, bias, grads) -> tuple[Tensor, Tensor, Tensor]:
    """(grad_hidden, grad_weight, grad_bias) with an empty [0] tensor for each gradient not computed (None):
    a custom op cannot return None."""
    likes = (hidden, weight, bias if bias is not None else weight)
    return tuple(g if g is not None else _empty_grad(like, False, None) for g, like in zip(grads, likes))


def _fake_grads(hidden, weight, bias, need_grad_hidden, need_grad_weight, need_grad_bias):
    """Fake (meta) gradients with the shapes the real ops return."""
    return (
        _empty_grad(hidden, need_grad_hidden, hidden.shape),
        _empty_grad(weight, need_grad_weight, weight.shape),
        _empty_grad(bias if bias is not None else weight, need_grad_bias and bias is not None,
                    bias.shape if bias is not None else None),
    )


def _forward_impl(hidden, weight, target, bias, ignore_index, label_smoothing, softcap, logit_scale, logit_divisor,
                  chunk_size, impl):
    if impl == "triton":
        from burstc.kernels.linear_cross_entropy_triton import triton_lce_forward

        return triton_lce_forward(
            hidden, weight, target, bias,
            ignore_index=ignore_index, label_smoothing=label_smoothing, softcap=softcap, logit_scale=logit_scale,
            logit_divisor=logit_divisor,
        )
    loss_N, lse_N, *_ = chunked_linear_cross_entropy(
        hidden, weight, target, bias,
        ignore_index=ignore_index, label_smoothing=label_smoothing, softcap=softcap, logit_scale=logit_scale,
        logit_divisor=logit_divisor, chunk_size=chunk_size,
    )
    return loss_N, lse_N


def _grads_impl(hidden, weight, target, bias, lse, token_grad_scale, ignore_index, label_smoothing, softcap, logit_scale,
                logit_divisor, chunk_size, impl, need_grad_hidden, need_grad_weight, need_grad_bias):
    if impl == "triton":
        from burstc.kernels.linear_cross_entropy_triton import triton_lce_backward

        return triton_lce_backward(
            hidden, weight, target, bias, lse, token_grad_scale,
            ignore_index=ignore_index, label_smoothing=label_smoothing, softcap=softcap, logit_scale=logit_scale,
            logit_divisor=logit_divisor,
            need_grad_hidden=need_grad_hidden, need_grad_weight=need_grad_weight, need_grad_bias=need_grad_bias,
        )
    _, _, grad_hidden, grad_weight, grad_bias = chunked_linear_cross_entropy(
        hidden, weight, target, bias,
        token_grad_scale_N=token_grad_scale,  # the CPU path recomputes lse with the fused softmax
        ignore_index=ignore_index, label_smoothing=label_smoothing, softcap=softcap, logit_scale=logit_scale,
        logit_divisor=logit_divisor, chunk_size=chunk_size,
        need_grad_hidden=need_grad_hidden, need_grad_weight=need_grad_weight, need_grad_bias=need_grad_bias,
    )
    return grad_hidden, grad_weight, grad_bias


# ---------------------------------------------------------------------------------------------------------------------
# burstc::linear_cross_entropy_with_grads


def _with_grads_impl(
    hidden: Tensor,
    weight: Tensor,
    target: Tensor,
    bias: Tensor | None,
    normalizer: Tensor,
    ignore_index: int,
    label_smoothing: float,
    softcap: float | None,
    logit_scale: float | None,
    logit_divisor: float | None,
    chunk_size: int,
    impl: str,
    need_grad_hidden: bool,
    need_grad_weight: bool,
    need_grad_bias: bool,
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """(loss, grad_hidden, grad_weight, grad_bias) with loss = sum_n loss_n / normalizer and its gradients.

    Gradients that are not needed come back as empty [0] tensors.
    """
    num_tokens = hidden.shape[0]
    loss_dtype = _loss_dtype(hidden.dtype)
    normalizer = normalizer.to(device=hidden.device, dtype=loss_dtype)
    # d loss / d loss_n = 1 / normalizer for every non-ignored token (the kernels zero ignored ones)
    token_grad_scale = torch.reciprocal(normalizer).expand(num_tokens)
    if impl == "triton":
        loss_N, lse_N = _forward_impl(hidden, weight, target, bias, ignore_index, label_smoothing, softcap,
                                      logit_scale, logit_divisor, chunk_size, impl)
        grad_hidden, grad_weight, grad_bias = _grads_impl(
            hidden, weight, target, bias, lse_N, token_grad_scale, ignore_index, label_smoothing, softcap, logit_scale,
            logit_divisor, chunk_size, impl, need_grad_hidden, need_grad_weight, need_grad_bias,
        )
    else:
        loss_N, _, grad_hidden, grad_weight, grad_bias = chunked_linear_cross_entropy(
            hidden, weight, target, bias,
            token_grad_scale_N=token_grad_scale,
            ignore_index=ignore_index, label_smoothing=label_smoothing, softcap=softcap, logit_scale=logit_scale,
            logit_divisor=logit_divisor, chunk_size=chunk_size,
            need_grad_hidden=need_grad_hidden, need_grad_weight=need_grad_weight, need_grad_bias=need_grad_bias,
        )
    loss = loss_N.sum() / normalizer
    return (loss, *_grads_or_empty(hidden, weight, bias, (grad_hidden, grad_weight, grad_bias)))


_lce_with_grads = torch.library.custom_op(
    "burstc::linear_cross_entropy_with_grads", without_autocast(_with_grads_impl), mutates_args=()
)


@_lce_with_grads.register_fake
def _lce_with_grads_fake(hidden, weight, target, bias, normalizer, ignore_index, label_smoothing, softcap,
                         logit_scale, logit_divisor, chunk_size, impl, need_grad_hidden, need_grad_weight,
                         need_grad_bias):
    loss = torch.empty((), dtype=_loss_dtype(hidden.dtype), device=hidden.device)
    return (loss, *_fake_grads(hidden, weight, bias, need_grad_hidden, need_grad_weight, need_grad_bias))


def _lce_with_grads_setup(ctx, inputs, output):
    loss, grad_hidden, grad_weight, grad_bias = output
    ctx.mark_non_differentiable(grad_hidden, grad_weight, grad_bias)
    # otherwise autograd hands backward zero-filled [V, H] / [N, H] "gradients" for these outputs: one more copy
    # of the gradients at the peak
    ctx.set_materialize_grads(False)
    # the loss only where the normalizer's gradient needs it, and a copy: models add to their loss in place
    # (Mixtral's `loss += coef * aux_loss`), which would bump a saved output's version and fail the backward
    loss_copy = loss.detach().clone() if ctx.needs_input_grad[4] else None
    ctx.save_for_backward(grad_hidden, grad_weight, grad_bias, loss_copy, inputs[4])


def _lce_with_grads_backward(ctx, grad_loss, _grad_gh, _grad_gw, _grad_gb):
    grad_hidden, grad_weight, grad_bias, loss, normalizer = ctx.saved_tensors
    needs = ctx.needs_input_grad
    if grad_loss is None:  # not materialized (see setup): the loss did not reach the differentiated output
        return (None,) * 15
    # the forward already holds d loss / d (hidden, weight, bias); the chain rule only scales them
    grad_normalizer = None
    if needs[4]:
        grad_normalizer = (-loss / normalizer * grad_loss).to(normalizer.dtype)
    return (
        _scaled(grad_hidden, grad_loss) if needs[0] else None,
        _scaled(grad_weight, grad_loss) if needs[1] else None,
        None,
        _scaled(grad_bias, grad_loss) if needs[3] else None,
        grad_normalizer,
        None, None, None, None, None, None, None, None, None, None,
    )


def _scaled(grad: Tensor, grad_loss: Tensor) -> Tensor:
    """``grad * grad_loss``.  Eagerly, when this backward frees the graph, the forward's buffer is scaled in
    place: an out-of-place product would hold a second [V, H] weight gradient at the peak (128 MiB at
    V = 32768, H = 1024 in fp32), and autograd can then hand the buffer itself to ``.grad``.  A backward that
    keeps the graph (``retain_graph=True``, gradcheck) gets the out-of-place product.  Traced (torch.compile)
    the product stays functional; Inductor reuses the buffer itself."""
    from torch.utils._python_dispatch import _get_current_dispatch_mode

    frees_graph = not torch._C._autograd._get_current_graph_task_keep_graph()
    if frees_graph and type(grad) is Tensor and _get_current_dispatch_mode() is None:
        # loss.backward() seeds 1: x * 1 == x exactly (NaN and inf included), so on CPU (where reading the seed is
        # no device sync) the pass over the [V, H] gradient is skipped
        if grad_loss.device.type == "cpu" and grad_loss.numel() == 1 and bool(grad_loss == 1):
            return grad
        return grad.mul_(grad_loss)
    return grad * grad_loss


_lce_with_grads.register_autograd(_lce_with_grads_backward, setup_context=_lce_with_grads_setup)


# ---------------------------------------------------------------------------------------------------------------------
# burstc::linear_cross_entropy_forward / burstc::linear_cross_entropy_backward


def _forward_op_impl(
    hidden: Tensor,
    weight: Tensor,
    target: Tensor,
    bias: Tensor | None,
    ignore_index: int,
    label_smoothing: float,
    softcap: float | None,
    logit_scale: float | None,
    logit_divisor: float | None,
    chunk_size: int,
    impl: str,
) -> tuple[Tensor, Tensor]:
    """(loss_N, lse_N): per-token losses (0 at ignored tokens) and log-sum-exp of the (softcapped) logits.

    lse is auxiliary (not differentiable); the CPU path skips ignored tokens and leaves their lse at 0.
    """
    loss_N, lse_N = _forward_impl(hidden, weight, target, bias, ignore_index, label_smoothing, softcap,
                                  logit_scale, logit_divisor, chunk_size, impl)
    return loss_N, lse_N


_lce_forward = torch.library.custom_op("burstc::linear_cross_entropy_forward", without_autocast(_forward_op_impl), mutates_args=())


@_lce_forward.register_fake
def _lce_forward_fake(hidden, weight, target, bias, ignore_index, label_smoothing, softcap, logit_scale, logit_divisor,
                      chunk_size, impl):
    num_tokens = hidden.shape[0]
    dtype = _loss_dtype(hidden.dtype)
    return (
        torch.empty(num_tokens, dtype=dtype, device=hidden.device),
        torch.empty(num_tokens, dtype=dtype, device=hidden.device),
    )


def _backward_op_impl(
    grad_loss: Tensor,
    hidden: Tensor,
    weight: Tensor,
    target: Tensor,
    bias: Tensor | None,
    lse: Tensor,
    ignore_index: int,
    label_smoothing: float,
    softcap: float | None,
    logit_scale: float | None,
    logit_divisor: float | None,
    chunk_size: int,
    impl: str,
    need_grad_hidden: bool,
    need_grad_weight: bool,
    need_grad_bias: bool,
) -> tuple[Tensor, Tensor, Tensor]:
    """Gradients of sum_n grad_loss_n * loss_n (recomputing logit chunks); [0] tensors where not needed."""
    grad_hidden, grad_weight, grad_bias = _grads_impl(
        hidden, weight, target, bias, lse, grad_loss, ignore_index, label_smoothing, softcap, logit_scale,
        logit_divisor, chunk_size, impl, need_grad_hidden, need_grad_weight, need_grad_bias,
    )
    return _grads_or_empty(hidden, weight, bias, (grad_hidden, grad_weight, grad_bias))


_lce_backward = torch.library.custom_op(
    "burstc::linear_cross_entropy_backward", without_autocast(_backward_op_impl), mutates_args=()
)


@_lce_backward.register_fake
def _lce_backward_fake(grad_loss, hidden, weight, target, bias, lse, ignore_index, label_smoothing, softcap,
                       logit_scale, logit_divisor, chunk_size, impl, need_grad_hidden, need_grad_weight,
                       need_grad_bias):
    return _fake_grads(hidden, weight, bias, need_grad_hidden, need_grad_weight, need_grad_bias)


def _lce_forward_setup(ctx, inputs, output):
    (hidden, weight, target, bias, ignore_index, label_smoothing, softcap, logit_scale, logit_divisor, chunk_size,
     impl) = inputs
    _, lse = output
    ctx.mark_non_differentiable(lse)  # auxiliary output
    ctx.set_materialize_grads(False)
    ctx.save_for_backward(hidden, weight, target, bias, lse)
    ctx.options = (ignore_index, label_smoothing, softcap, logit_scale, logit_divisor, chunk_size, impl)
    ctx.has_bias = bias is not None


def _lce_forward_backward(ctx, grad_loss, _grad_lse):
    hidden, weight, target, bias, lse = ctx.saved_tensors
    if grad_loss is None:  # not materialized: the per-token losses did not reach the differentiated output
        return (None,) * 11
    needs = ctx.needs_input_grad
    need_grad_bias = ctx.has_bias and needs[3]
    grad_hidden, grad_weight, grad_bias = _lce_backward(
        grad_loss.contiguous(), hidden, weight, target, bias, lse, *ctx.options, needs[0], needs[1], need_grad_bias
    )
    return (
        grad_hidden if needs[0] else None,
        grad_weight if needs[1] else None,
        None,
        grad_bias if need_grad_bias else None,
        None, None, None, None, None, None, None,
    )


_lce_forward.register_autograd(_lce_forward_backward, setup_context=_lce_forward_setup)


# ---------------------------------------------------------------------------------------------------------------------
# public API


def _resolve_impl(impl: str, device: torch.device) -> str:
    if impl == "auto":
        return "triton" if device.type == "cuda" and _TRITON_INSTALLED else "torch"
    if impl == "triton" and not _TRITON_INSTALLED:
        raise RuntimeError("linear_cross_entropy: impl='triton' needs the triton package")
    return impl


def _validate(hidden, weight, target, bias, reduction, normalizer, label_smoothing, softcap, logit_scale, logit_divisor,
              chunk_size, impl, class_weight):
    if class_weight is not None:
        raise NotImplementedError(
            "linear_cross_entropy: per-class weights (F.cross_entropy(weight=...)) are not supported by the fused "
            "op; use the unfused F.linear + F.cross_entropy"
        )
    if reduction not in REDUCTIONS:
        raise ValueError(f"linear_cross_entropy: reduction must be one of {REDUCTIONS}, got {reduction!r}")
    if impl not in IMPLS:
        raise ValueError(f"linear_cross_entropy: impl must be one of {IMPLS}, got {impl!r}")
    if not isinstance(hidden, Tensor) or not isinstance(weight, Tensor) or not isinstance(target, Tensor):
        raise TypeError("linear_cross_entropy: hidden, weight and target must be tensors")
    if hidden.dim() < 1:
        raise ValueError("linear_cross_entropy: hidden must have shape [..., H]")
    if weight.dim() != 2:
        raise ValueError(f"linear_cross_entropy: weight must have shape [V, H], got {tuple(weight.shape)}")
    if hidden.shape[-1] != weight.shape[1]:
        raise ValueError(
            f"linear_cross_entropy: hidden size mismatch: hidden {tuple(hidden.shape)} vs weight {tuple(weight.shape)}"
        )
    if hidden.dtype not in _SUPPORTED_DTYPES:
        raise TypeError(f"linear_cross_entropy: unsupported hidden dtype {hidden.dtype}")
    if weight.dtype != hidden.dtype:
        raise TypeError(f"linear_cross_entropy: weight dtype {weight.dtype} != hidden dtype {hidden.dtype}")
    if bias is not None:
        if tuple(bias.shape) != (weight.shape[0],):
            raise ValueError(
                f"linear_cross_entropy: bias must have shape ({weight.shape[0]},), got {tuple(bias.shape)}"
            )
        if bias.dtype != hidden.dtype:
            raise TypeError(f"linear_cross_entropy: bias dtype {bias.dtype} != hidden dtype {hidden.dtype}")
    if target.dtype.is_floating_point or target.dtype.is_complex or target.dtype == torch.bool:
        raise TypeError(
            f"linear_cross_entropy: target must hold integer class indices (int64), got {target.dtype}; "
            "class-probability targets are not supported"
        )
    if tuple(target.shape) != tuple(hidden.shape[:-1]):
        raise ValueError(
            f"linear_cross_entropy: target shape {tuple(target.shape)} must equal hidden.shape[:-1] "
            f"{tuple(hidden.shape[:-1])}"
        )
    for name, tensor in (("weight", weight), ("target", target), ("bias", bias)):
        if tensor is not None and tensor.device != hidden.device:
            raise ValueError(f"linear_cross_entropy: {name} is on {tensor.device}, hidden on {hidden.device}")
    if normalizer is not None and (not isinstance(normalizer, Tensor) or normalizer.dim() != 0):
        raise ValueError("linear_cross_entropy: normalizer must be a 0-d tensor")
    if not 0.0 <= float(label_smoothing) <= 1.0:
        raise ValueError(f"linear_cross_entropy: label_smoothing must be in [0, 1], got {label_smoothing}")
    if softcap is not None and not float(softcap) > 0.0:
        raise ValueError(f"linear_cross_entropy: softcap must be > 0 or None, got {softcap}")
    if logit_scale is not None and not math.isfinite(float(logit_scale)):
        raise ValueError(f"linear_cross_entropy: logit_scale must be a finite number or None, got {logit_scale}")
    if logit_divisor is not None and not (math.isfinite(float(logit_divisor)) and float(logit_divisor) != 0.0):
        raise ValueError(
            f"linear_cross_entropy: logit_divisor must be a finite non-zero number or None, got {logit_divisor}")
    if logit_scale is not None and logit_divisor is not None:
        raise ValueError("linear_cross_entropy: give logit_scale or logit_divisor, not both")
    if chunk_size is not None and (not isinstance(chunk_size, int) or isinstance(chunk_size, bool) or chunk_size <= 0):
        raise ValueError(f"linear_cross_entropy: chunk_size must be a positive int or None, got {chunk_size!r}")


def linear_cross_entropy(
    hidden: Tensor,
    weight: Tensor,
    target: Tensor,
    bias: Tensor | None = None,
    *,
    ignore_index: int = -100,
    reduction: str = "mean",
    normalizer: Tensor | None = None,
    label_smoothing: float = 0.0,
    softcap: float | None = None,
    logit_scale: float | None = None,
    logit_divisor: float | None = None,
    chunk_size: int | None = None,
    impl: str = "auto",
    class_weight: Tensor | None = None,
) -> Tensor:
    """``F.cross_entropy(softcap((F.linear(hidden, weight, bias) * logit_scale).float()), target, ...)`` without
    [N, V] logits.

    Args:
        hidden: ``[..., H]`` (any leading dims; flattened to N tokens), fp32 / bf16 / fp16 (fp64 for gradchecks).
        weight: ``[V, H]``, same dtype. bias: ``[V]`` or None.
        target: integer class indices with shape ``hidden.shape[:-1]``; ``ignore_index`` entries contribute 0.
        reduction: ``"mean"`` (sum over non-ignored tokens / normalizer), ``"sum"`` (sum, divided by ``normalizer``
            only when one is given), ``"none"`` (per-token losses, shape of ``target``, 0 at ignored tokens).
        normalizer: optional 0-d tensor replacing the non-ignored token count of "mean" (or dividing "sum"); a
            sequence-parallel caller passes the *global* count. Without it, the count is computed as a tensor
            (no host sync), so all-ignored "mean" is 0/0 = NaN exactly like eager. It receives a gradient when it
            is a floating tensor that requires grad.
        label_smoothing: eps in [0, 1]: loss = (1 - eps)(lse - z_t) + eps(lse - mean_v z_v), as F.cross_entropy.
        softcap: c > 0: logits z = c * tanh(x / c) (in fp32) before the loss.
        logit_scale: s: the linear's output is multiplied by s in the input dtype (rounded there, as eager's
            ``logits * s`` of Cohere models), before the upcast and the softcap.
        logit_divisor: d: the linear's output is divided by d in the input dtype (Granite's ``logits /
            logits_scaling``): ``x / d`` and ``x * (1 / d)`` can differ in the last bit unless d is a power
            of two, so the kernels divide, in the forward and in the chain rule of the backward, as eager does.
        chunk_size: tokens per chunk of the CPU/torch path (default: :func:`default_chunk_size`).
        impl: ``"auto"`` (Triton on CUDA, chunked torch elsewhere), ``"torch"`` or ``"triton"`` (on CPU only under
            TRITON_INTERPRET=1).
        class_weight: per-class weights are not supported (raises NotImplementedError).

    Returns the fp32 loss (fp64 for fp64 inputs): logits come from the matmul in the input dtype and are upcast to
    fp32 for the softmax, matching HF / eager ``F.cross_entropy(logits.float(), ...)``. For mean/sum with gradients
    enabled and any input requiring grad, all gradients are computed during the forward and backward only scales
    them; otherwise only the forward runs ("none" recomputes logit chunks in its backward).

    Under ``torch.autocast``, hidden, weight and bias are cast to the region's dtype first, as ``F.linear``'s
    are: the logits are the ones eager autocast computes.
    """
    if isinstance(hidden, Tensor):
        hidden, weight, bias = cast_like_lower_precision((hidden, weight, bias), hidden.device.type)
    _validate(hidden, weight, target, bias, reduction, normalizer, label_smoothing, softcap, logit_scale, logit_divisor,
              chunk_size, impl, class_weight)
    hidden_size = hidden.shape[-1]
    vocab = weight.shape[0]
    hidden_NH = hidden.reshape(-1, hidden_size)
    target_N = target.reshape(-1)
    if target_N.dtype != torch.int64:
        target_N = target_N.long()
    resolved_impl = _resolve_impl(impl, hidden.device)
    logit_scale = None if logit_scale is None or float(logit_scale) == 1.0 else float(logit_scale)
    logit_divisor = None if logit_divisor is None or float(logit_divisor) == 1.0 else float(logit_divisor)
    if chunk_size is None:
        # from N only when it is a concrete int: a dynamic (symbolic) token count must not specialize
        num_tokens = hidden_NH.shape[0] if type(hidden_NH.shape[0]) is int else None
        chunk_size = default_chunk_size(num_tokens, vocab, hidden_size, hidden.dtype, softcap=softcap is not None)
    options = (int(ignore_index), float(label_smoothing), None if softcap is None else float(softcap),
               logit_scale, logit_divisor, int(chunk_size), resolved_impl)
    loss_dtype = _loss_dtype(hidden.dtype)

    if reduction == "none":
        loss_N, _ = _lce_forward(hidden_NH, weight, target_N, bias, *options)
        return loss_N.reshape(target.shape)

    if normalizer is None and reduction == "mean":
        normalizer = ((target_N != ignore_index) & (target_N != PADDING_TARGET)).sum()
    need_grad_hidden = hidden.requires_grad
    need_grad_weight = weight.requires_grad
    need_grad_bias = bias is not None and bias.requires_grad
    if torch.is_grad_enabled() and (need_grad_hidden or need_grad_weight or need_grad_bias):
        if normalizer is None:
            normalizer = torch.ones((), dtype=loss_dtype, device=hidden.device)
        loss, _, _, _ = _lce_with_grads(
            hidden_NH, weight, target_N, bias, normalizer, *options,
            need_grad_hidden, need_grad_weight, need_grad_bias,
        )
        return loss
    loss_N, _ = _lce_forward(hidden_NH, weight, target_N, bias, *options)
    total = loss_N.sum()
    return total if normalizer is None else total / normalizer.to(loss_dtype)
