"""Fused LM-head + cross-entropy on CPU (and any torch device): plain-torch reference and chunked kernel.

Notation: N tokens, H hidden size, V vocabulary size, C tokens per chunk.

Semantics (what the chunked kernel reproduces, i.e. eager ``F.cross_entropy(F.linear(h, W, b).float(), t)``):

- logits ``x = h @ W^T + b`` are computed by the matmul in the *input* dtype (so bf16 logits are rounded to bf16
  once, exactly like the eager model), then upcast to fp32;
- optional logit scale ``x = x * s`` in the input dtype (Cohere's and Granite's ``logits * s``: rounded there, like
  eager), then the optional softcap ``z = c * tanh(x / c)`` in fp32;
- per-token loss ``lse(z) - (1 - eps) * z_t - eps * mean_v(z_v)`` (label smoothing as in F.cross_entropy), 0 at
  ignored tokens;
- gradient w.r.t. the logits ``(softmax(z) - (1 - eps) * onehot(t) - eps / V) * dloss * (1 - (z / c)^2)`` in fp32,
  rounded to the input dtype before the two gradient matmuls (as eager autograd does). grad_hidden is then exact
  per chunk (a token's row never spans chunks). grad_weight sums over chunks in an fp32 accumulator rounded to the
  weight dtype once at the end: fp32 inputs accumulate inside one fp32 GEMM per chunk; low-precision inputs run the
  chunk's partial product as a bf16 GEMM (fp32 accumulation over the chunk's tokens inside the GEMM, one rounding
  of the partial) and add it in fp32 - CPU has no bf16 x bf16 -> fp32 GEMM (aten::mm.dtype is CUDA-only) and an
  fp32 GEMM is ~3x slower. Chunks never accumulate in bf16 (the pitfall that makes naive chunking drift).

The chunked kernel never holds more than one chunk of logits: extra memory is O(C * V) plus the gradients. On CPU
it walks only the non-ignored tokens (gathering their rows chunk by chunk), so masked prompt tokens cost nothing.

Longer than ~400 lines because it holds one kernel family whole: the plain-torch reference beside the chunked
forward and backward (fp32 vocab-major and low-precision token-major chunk layouts), and the memory arithmetic
that sizes their chunks; the reference must stay next to what it checks.
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
    "EAGER_BYTES_PER_LOGIT",
    "PADDING_TARGET",
]

# Transient budget for a chunk's [C, V] GEMM-output buffer (see default_chunk_size): 32 MiB = 256 rows at
# V = 32768 in fp32.
TRANSIENT_BUDGET_BYTES = 32 * 2**20
# Chunks grow past the budget towards these GEMM-friendly sizes while the [C, V] buffer stays within a multiple of
# the fp32 weight-gradient accumulator (V * H * 4 bytes), i.e. when the accumulator dominates memory anyway.
# Measured on the 2-core CPU: bf16 GEMMs of the three LM-head shapes ran at ~230 GFLOP/s with 256-512 rows and
# ~360-400 with 1024-2048; fp32 at ~120 GFLOP/s with 128 rows and ~150-170 with 512-1024 (H = 1024, V = 65536).
# End to end (16384 x 1024 x 65536 bf16): 19.2 s with 1024-row chunks, 18.8 s with 2048.
_TARGET_ROWS = {"low_precision": 2048, "fp32": 512}
_ACCUMULATOR_MULTIPLE = {"low_precision": 2, "fp32": 1}
# Eager's measured peak for F.cross_entropy(F.linear(h, W).float(), t) forward + backward, per logit, in fp32 and in
# bf16 (logits, their fp32 upcast, softmax, gradients): 1536 MiB at 4096 x 32768, 6144 MiB at 16384 x 32768.
EAGER_BYTES_PER_LOGIT = 12
# The share of eager's peak the op aims to stay within: 1/8, less 5% for what the arithmetic leaves out (the
# loss vector, gather indices, allocator rounding: ~3 MiB at 4096 tokens)
_EAGER_SHARE = 0.95 / 8
# Rows per chunk are a multiple of this (matmul blocking), unless the whole input is smaller.
_CHUNK_ROW_MULTIPLE = 16
# Rows per softmax block: the fp32 passes run on at most this many rows at a time (8 MiB at V = 32768, mostly
# L3-resident), so low precision needs no fp32 copy of the whole chunk.
_SOFTMAX_BLOCK_ROWS = 64
# fp32 chunks on CPU keep their logits vocab-major (see _chunk_loop)
_VOCAB_MAJOR_FP32 = True
# Target probabilities below this get their row's log-sum-exp from the row maximum instead (see _softmax_block).
_TINY_PROBABILITY = 1e-30
# The target of a row that is not in the user's batch: the shard pass pads a length the mesh does not divide with
# it (not a class index, and eager raises on any negative target but ignore_index, so no user batch holds it).
# Such a row adds nothing at all, where an ignored row adds eager's 0 x NaN. Exact as a float (shard_seq's pad
# value is one).
PADDING_TARGET = -(2**62)
# Ignored rows whose |logits| bound (see _rows_with_nonfinite_logits) is below this share of the input dtype's
# largest value can't overflow, even after the GEMM's rounding: their eager gradient is exactly 0.
_FINITE_LOGIT_SHARE = 0.25
# Rows per block of that bound's [rows, H] fp32 scratch (4 MiB at H = 1024)
_BOUND_BLOCK_ROWS = 1024
# Bytes of one low-precision weight-gradient partial product ([S, H] slice of the [V, H] product).
_WEIGHT_GRAD_PARTIAL_BYTES = 4 * 2**20
# Bytes of the fp32 staging buffer the partial passes through on its way into the accumulator (a mixed-dtype
# fp32 += bf16 add_ measured ~3x slower than copy-to-fp32 + fp32 add_ on this build).
_WEIGHT_GRAD_STAGING_BYTES = 4 * 2**20


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
    logit_scale: float | None = None,
    logit_divisor: float | None = None,
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
    # in the input dtype (one rounding), as the model's `logits * scale` or `logits / divisor`
    logits = scale_logits(logits, logit_scale, logit_divisor)
    if compute_dtype == torch.float64 and logits.dtype != torch.float64:
        exact = F.linear(hidden.double(), weight.double(), None if bias is None else bias.double())
        exact = scale_logits(exact, logit_scale, logit_divisor)
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
    """Tokens per chunk (C) of the chunked kernel, from the memory arithmetic below.

    Transient buffers (V = vocab, H = hidden, e = bytes of the input dtype, B = 64 softmax-block rows):
      [C, V] GEMM output in the input dtype (logits; in low precision later the rounded dlogits)   C * V * e
      [B, V] fp32 softmax block (low precision only; fp32 inputs run the softmax in the GEMM output)  B * V * 4
      [B, V] fp32 tanh(x / c) for the softcap derivative (softcap only)                               B * V * 4
      [S, H] bf16 weight-grad partial + fp32 staging (low precision only)                           4 + 4 MiB
    C = min(target, max(TRANSIENT_BUDGET_BYTES / (V * e), k * V * H * 4 / (V * e))): the budget, or more rows
    while the [C, V] buffer stays within k times the fp32 weight-grad accumulator (k = 2 low precision, 1 fp32),
    never past a GEMM-friendly target (2048 low precision, 512 fp32). The target also caps a small vocabulary's
    budget: more rows only push the chunk out of cache (fp32, H = 128, V = 4096, N = 2048: 51 ms with 512 rows,
    76 ms with the budget's 2048; H = 256, V = 2048, N = 4096: 97 vs 119 ms; bf16 H = 256, V = 4096: 69 ms with
    2048 rows vs 82 with 4096). Low precision also adds each chunk's V x H
    weight-grad partial into the accumulator (a memory-bound pass worth ~50 / C of the chunk's GEMM time), another
    reason for large chunks. Examples:
      bf16, V = 32768, H = 256    -> 1024 rows (64 MiB next to a 32 MiB accumulator)
      bf16, V = 65536, H = 1024   -> 2048 rows (256 MiB next to a 256 MiB accumulator)
      bf16, V = 262144, H = 64    -> 256 rows (128 MiB, twice the 64 MiB accumulator; the budget alone: 64)
      fp32, V = 32768, H = 256    -> 256 rows (32 MiB, the budget; = the accumulator)
      fp32, V = 65536, H = 1024   -> 512 rows (128 MiB next to 256 MiB)
    The whole op then holds, besides the transient,
      V * H * 4 (the fp32 weight-grad accumulator; in low precision the weight gradient itself holds half of it,
      see _SplitAccumulator) + N * H * e (the hidden gradient),
    against N * V * (2e + 12) bytes for eager (logits, fp32 upcast, log-softmax, fp32 and input-dtype grads).
    ``softcap`` only adds the fixed block buffer. ``num_tokens`` (when known) caps the chunk, and so does 1/8 of
    eager's peak (EAGER_BYTES_PER_LOGIT * N * V, less 5%) less the fixed part above, down to the budget's rows:
    e.g. N = 4096, V = 32768, H = 1024: fp32 -> 304 rows (144 MiB fixed + 38 MiB, within 1536 / 8), bf16 -> 512
    rows (152 MiB with the fp32 block and partial buffers leave 30 MiB: 480 rows, below the budget's 512). Where the fixed part alone exceeds 1/8 (few tokens, large V * H) the chunk stays at
    the budget. A floor of 16 rows keeps the GEMMs efficient.
    """
    del softcap  # the softcap buffer has a fixed number of rows
    elem = torch.empty((), dtype=dtype).element_size()
    kind = "low_precision" if elem < 4 else "fp32"
    row_bytes = max(vocab * elem, 1)
    budget_rows = TRANSIENT_BUDGET_BYTES // row_bytes
    growth_rows = (_ACCUMULATOR_MULTIPLE[kind] * vocab * hidden * 4) // row_bytes
    rows = min(_TARGET_ROWS[kind], max(budget_rows, growth_rows))
    if isinstance(num_tokens, int) and num_tokens > 0:
        # Few tokens: eager's own peak is small, so keep the op within 1/8 of it where the fixed part allows
        # (never below the budget's rows, or the rows chosen, if smaller)
        fixed_bytes = vocab * hidden * 4 + num_tokens * hidden * elem  # see "The whole op then holds"
        if kind == "low_precision":  # the fp32 softmax block and the weight-grad partial + staging buffers
            fixed_bytes += _SOFTMAX_BLOCK_ROWS * vocab * 4 + _WEIGHT_GRAD_PARTIAL_BYTES + _WEIGHT_GRAD_STAGING_BYTES
        spare_bytes = int(EAGER_BYTES_PER_LOGIT * num_tokens * vocab * _EAGER_SHARE) - fixed_bytes
        rows = min(rows, max(spare_bytes // row_bytes, min(budget_rows, rows)))
    rows = max(_CHUNK_ROW_MULTIPLE, rows - rows % _CHUNK_ROW_MULTIPLE)
    if isinstance(num_tokens, int) and num_tokens > 0:
        rows = min(rows, num_tokens)
    return int(rows)


def scale_logits(logits: Tensor, logit_scale: float | None, logit_divisor: float | None, *, in_place: bool = False
                 ) -> Tensor:
    """``logits * s`` or ``logits / d`` (or ``logits`` when both are None) in the logits' dtype, as the model wrote
    it: ``x / 3`` and ``x * (1 / 3)`` round differently, so a divisor is divided by, never inverted. The chain
    rule applies the same operation to the gradient (eager's ``div`` backward is ``grad / d``)."""
    if logit_scale is not None:
        return logits.mul_(logit_scale) if in_place else logits * logit_scale
    if logit_divisor is not None:
        return logits.div_(logit_divisor) if in_place else logits / logit_divisor
    return logits


def chunked_linear_cross_entropy(
    hidden_NH: Tensor,
    weight_VH: Tensor,
    target_N: Tensor,
    bias_V: Tensor | None = None,
    *,
    token_grad_scale_N: Tensor | None = None,
    ignore_index: int = -100,
    label_smoothing: float = 0.0,
    softcap: float | None = None,
    logit_scale: float | None = None,
    logit_divisor: float | None = None,
    chunk_size: int | None = None,
    need_grad_hidden: bool = True,
    need_grad_weight: bool = True,
    need_grad_bias: bool = True,
) -> tuple[Tensor, Tensor, Tensor | None, Tensor | None, Tensor | None]:
    """Token-chunked linear + cross-entropy. Returns (loss_N, lse_N, grad_hidden, grad_weight, grad_bias).

    loss_N / lse_N are fp32 per-token losses (0 at ignored tokens) and log-sum-exps (of the softcapped logits).
    With ``token_grad_scale_N`` (fp32 [N], d total_loss / d loss_n) the gradients of ``sum_n scale_n * loss_n`` are
    computed in the same chunk loop (3 matmuls per chunk: logits, grad_hidden, grad_weight); otherwise they are None
    and only the logits matmul runs. A backward that recomputes simply calls this again with its grad_output as
    the scale (recomputing the fused softmax is cheaper on CPU than exp(z - saved_lse)).
    """
    num_tokens, hidden_size = hidden_NH.shape
    vocab = weight_VH.shape[0]
    dtype, device = hidden_NH.dtype, hidden_NH.device
    work_dtype = torch.float64 if dtype == torch.float64 else torch.float32
    with_grads = token_grad_scale_N is not None
    need_grad_hidden &= with_grads
    need_grad_weight &= with_grads
    need_grad_bias &= with_grads and bias_V is not None
    if chunk_size is None:
        chunk_size = default_chunk_size(num_tokens, vocab, hidden_size, dtype, softcap=softcap is not None)
    hidden_NH = hidden_NH.contiguous()

    # Rows the shard pass appended so that the length divides the mesh (target PADDING_TARGET) are not in the
    # user's batch: nothing of theirs may reach a gradient, not even a NaN. Past this point they are ignored rows
    # that the NaN rule below never computes (the accelerator path, which computes every row, zeroes them).
    padding_N = target_N == PADDING_TARGET
    skips_rows = _skips_rows(device)
    if skips_rows and not bool(padding_N.any()):
        padding_N = None
    if padding_N is not None:
        target_N = target_N.masked_fill(padding_N, ignore_index)

    # Ignored tokens contribute nothing: on CPU the chunks walk only the valid ones (gathering their rows), which
    # saves their share of all three GEMMs (SFT prompts are often half the tokens). The index costs a host sync on
    # accelerators, so there every token is computed and masked instead (0 x a NaN row's dlogits is NaN there, as
    # in eager). Except: eager's gradient of an ignored row is 0 x (its softmax, and its hidden state in
    # dlogits^T @ hidden), NaN where those are not finite, so the ignored rows whose logits may not be finite are
    # computed too, with a row scale of 0 (see _rows_with_nonfinite_logits).
    computed_index = None
    computes_ignored = False
    valid_rows = None  # with computes_ignored: the computed rows [0, valid_rows) are valid, the rest ignored
    if skips_rows and num_tokens > 0:
        valid_N = target_N != ignore_index
        if not bool(valid_N.all()):
            computed_index = valid_N.nonzero().squeeze(1)
            if need_grad_hidden or need_grad_weight or need_grad_bias:
                ignored_N = ~valid_N if padding_N is None else ~valid_N & ~padding_N
                nonfinite_N = _rows_with_nonfinite_logits(
                    hidden_NH, weight_VH, bias_V, ignored_N, logit_scale, logit_divisor)
                if nonfinite_N is not None:
                    # in chunks of their own, after the valid rows: a low-precision GEMM on CPU may spill one
                    # row's NaN into its neighbour's product (oneDNN's bf16 kernel pairs rows), never across chunks
                    valid_rows, computes_ignored = computed_index.numel(), True
                    computed_index = torch.cat([computed_index, nonfinite_N.nonzero().squeeze(1)])
    active_tokens = num_tokens if computed_index is None else computed_index.numel()

    loss_out_N = torch.zeros(num_tokens, dtype=work_dtype, device=device)
    # lse of skipped (ignored) tokens stays 0: it is not needed by anything
    lse_out_N = torch.zeros(num_tokens, dtype=work_dtype, device=device)
    grad_hidden_NH = None
    if need_grad_hidden:
        grad_hidden_NH = torch.empty_like(hidden_NH) if computed_index is None else torch.zeros_like(hidden_NH)
    grad_weight_acc_VH = None
    if need_grad_weight:
        # Left unwritten when some chunk will run: the first chunk's product is written, not added (one pass less
        # over the V x H accumulator, and no zero fill)
        grad_weight_acc_VH = (
            _SplitAccumulator(vocab, hidden_size, dtype, device, zero=active_tokens == 0) if work_dtype != dtype
            else (torch.empty if active_tokens else torch.zeros)(vocab, hidden_size, dtype=work_dtype, device=device)
        )
    grad_bias_acc_V = torch.zeros(vocab, dtype=work_dtype, device=device) if need_grad_bias else None
    # One scale for every computed row (the mean/sum loss's 1 / normalizer, with the ignored rows skipped or
    # absent; computed ignored rows need their 0 instead) and fp32 work: the rows' dlogits stay unscaled and the
    # three gradients are scaled once at the end, one pass over N x H + V x H instead of one over every chunk's
    # C x V. Low precision scales before rounding the dlogits (as eager autograd does).
    uniform_scale = None
    if (with_grads and work_dtype == dtype and token_grad_scale_N.numel() and token_grad_scale_N.stride(0) == 0
            and skips_rows and not computes_ignored):
        uniform_scale = token_grad_scale_N[0].to(work_dtype)
    if active_tokens > 0:  # the chunk buffers live in _chunk_loop's frame: freed before the casts in _finish
        _chunk_loop(
            hidden_NH, weight_VH, target_N, bias_V, token_grad_scale_N, computed_index,
            loss_out_N, lse_out_N, grad_hidden_NH, grad_weight_acc_VH, grad_bias_acc_V,
            ignore_index=ignore_index, smoothing=float(label_smoothing), softcap=softcap, logit_scale=logit_scale,
            logit_divisor=logit_divisor, padding_N=padding_N if computed_index is None else None, split_at=valid_rows,
            chunk=max(1, min(int(chunk_size), active_tokens)), scale_rows=uniform_scale is None,
        )
        if grad_bias_acc_V is not None:  # the chunks summed the bias gradient before the scale's chain rule
            scale_logits(grad_bias_acc_V, logit_scale, logit_divisor, in_place=True)
    if uniform_scale is not None and active_tokens > 0:  # (no rows: the gradients stay 0, even for 1 / 0)
        for grad in (grad_hidden_NH, grad_weight_acc_VH, grad_bias_acc_V):
            if grad is not None:
                grad.mul_(uniform_scale)
    return _finish(loss_out_N, lse_out_N, grad_hidden_NH, grad_weight_acc_VH, grad_bias_acc_V, weight_VH, bias_V)


def _skips_rows(device: torch.device) -> bool:
    """Whether the chunks walk only the rows that need computing (CPU: the index's host sync is free), or every
    row (accelerators). Tests patch it to run the every-row path on CPU."""
    return device.type == "cpu"


def _rows_with_nonfinite_logits(hidden_NH, weight_VH, bias_V, ignored_N, logit_scale=None, logit_divisor=None
                                ) -> Tensor | None:
    """Bool [N]: the ``ignored_N`` rows whose eager gradient may not be zero, or None when there are none.

    Eager differentiates an ignored row too: its dlogits are 0 x softmax (NaN where its logits are not finite),
    its weight-gradient terms 0 x hidden (NaN where a hidden entry is not finite), its hidden gradient
    0 x weight. A row with finite hidden states, finite weights and bias and no overflow has exactly zero of
    each. The test is a bound on |logits|: sum_h |x_nh| * max |W| * |s| + max |b| below a quarter of the input
    dtype's largest value (NaN or inf anywhere in it fails the test, as it should). Cost: one contiguous
    ``aminmax`` pass over W (no [V, H] temporary) and one over the ignored rows' hidden states (a [1024, H] fp32
    block at a time): O(V·H + N·H) time against the op's O(N·V·H), O(1024·H) memory. Measured (busy 2-core CPU,
    N = 1024 with 30% ignored, V = 32768, H = 1024): 84 ms fp32 / 101 ms bf16 against 6.4 s / 4.0 s for the op's
    forward and backward, 1.3% / 2.5%, falling as 1 / N. The rows it flags are then computed
    like valid rows (row scale 0), which costs their share of the GEMMs only when such rows exist. (A per-column
    max of |W| would be tighter, but a strided reduction over V measured 20x slower.)"""
    ignored_index = ignored_N.nonzero().squeeze(1)
    if ignored_index.numel() == 0:
        return None
    work_dtype = torch.float64 if hidden_NH.dtype == torch.float64 else torch.float32
    low, high = torch.aminmax(weight_VH)
    weight_absmax = torch.maximum(high.to(work_dtype), -low.to(work_dtype))
    if logit_scale is not None:
        weight_absmax = weight_absmax * abs(float(logit_scale))
    if logit_divisor is not None:
        weight_absmax = weight_absmax / abs(float(logit_divisor))
    offset = 0.0
    if bias_V is not None:
        bias_low, bias_high = torch.aminmax(bias_V)
        offset = torch.maximum(bias_high.to(work_dtype), -bias_low.to(work_dtype))
    limit = torch.finfo(hidden_NH.dtype).max * _FINITE_LOGIT_SHARE
    nonfinite_N = torch.zeros_like(ignored_N)
    for start in range(0, ignored_index.numel(), _BOUND_BLOCK_ROWS):
        rows = ignored_index[start:start + _BOUND_BLOCK_ROWS]
        bound_R = hidden_NH[rows].to(work_dtype).abs_().sum(dim=1) * weight_absmax + offset
        nonfinite_N[rows] = ~(bound_R < limit)
    return nonfinite_N if bool(nonfinite_N.any()) else None


def _chunk_loop(
    hidden_NH, weight_VH, target_N, bias_V, token_grad_scale_N, computed_index,
    loss_out_N, lse_out_N, grad_hidden_NH, grad_weight_acc_VH, grad_bias_acc_V,
    *, ignore_index, smoothing, softcap, chunk, scale_rows=True, logit_scale=None, logit_divisor=None, padding_N=None,
    split_at=None,
):
    """The chunk loop of chunked_linear_cross_entropy; writes into the *_out / grad_* tensors in place.

    Chunks cover tokens [start, stop) or, with ``computed_index``, the listed tokens (rows gathered per chunk).
    ``padding_N`` (bool [N], chunks of every token only): rows whose hidden states and dlogits are zeroed.
    ``split_at``: no chunk spans that position of the rows walked.
    GEMMs run on chunks of C rows; the softmax passes on blocks of at most _SOFTMAX_BLOCK_ROWS rows of a chunk,
    in an fp32 block buffer (low precision) or in place in the fp32 GEMM output (vocab-major on CPU: the whole
    chunk is one block). Low precision writes each block's rounded dlogits back over its (consumed) logits rows, so
    a chunk costs C * V * e + block * V * 4 bytes.
    """
    hidden_size = hidden_NH.shape[1]
    active_tokens = hidden_NH.shape[0] if computed_index is None else computed_index.numel()
    vocab = weight_VH.shape[0]
    dtype, device = hidden_NH.dtype, hidden_NH.device
    work_dtype = loss_out_N.dtype
    low_precision = dtype != work_dtype
    with_grads = token_grad_scale_N is not None
    weight_t_HV = weight_VH.t()
    # fp32 on CPU keeps the chunk's logits vocab-major (a [V, C] buffer seen as its [C, V] transpose): the logits
    # GEMM W @ h^T writing [V, C] ran 1.25-1.35x faster than h @ W^T writing [C, V] (H = 1024, V = 65536, C =
    # 368-512: 136 vs 103-111 GFLOP/s), the two gradient GEMMs 1.0-1.05x; the softmax over the strided vocab
    # axis costs more than the fused row softmax (4 passes, ~40 ms vs ~9 ms per 96 MiB chunk), a net 8-10% per
    # chunk. The whole chunk is one softmax block then (the fp32 passes run in place in the GEMM output anyway).
    # Low precision keeps rows (its fp32 block copies want contiguous rows), and so does softcap (its tanh buffer
    # would grow from a block to the chunk).
    vocab_major = _VOCAB_MAJOR_FP32 and not low_precision and softcap is None and device.type == "cpu"
    block = chunk if vocab_major else min(chunk, _SOFTMAX_BLOCK_ROWS)

    # Buffers allocated once and reused: fresh [C, V] allocations are page-faulted on every chunk (measured
    # ~10x slower than writing into a warm buffer).
    # the chunk's logits (GEMM output), then its dlogits: row-major [C, V] or vocab-major [V, C]
    logits_buffer = torch.empty(chunk * vocab, dtype=dtype, device=device)
    work_BV = torch.empty(block, vocab, dtype=work_dtype, device=device) if low_precision else None
    tanh_BV = torch.empty(block, vocab, dtype=work_dtype, device=device) if softcap is not None else None
    loss_C = torch.empty(chunk, dtype=work_dtype, device=device)
    lse_C = torch.empty(chunk, dtype=work_dtype, device=device)
    weight_grad_partial = None
    if grad_weight_acc_VH is not None and low_precision:
        partial_rows = max(1, min(vocab, _WEIGHT_GRAD_PARTIAL_BYTES // (hidden_size * hidden_NH.element_size())))
        staging_rows = max(1, min(partial_rows, _WEIGHT_GRAD_STAGING_BYTES // (hidden_size * 4)))
        weight_grad_partial = (
            torch.empty(partial_rows, hidden_size, dtype=dtype, device=device),
            torch.empty(staging_rows, hidden_size, dtype=work_dtype, device=device),
        )
    gathered = None
    if computed_index is not None:  # per-chunk gathers of the computed tokens' rows
        gathered = (
            torch.empty(chunk, hidden_size, dtype=dtype, device=device),
            torch.empty(chunk, hidden_size, dtype=dtype, device=device) if grad_hidden_NH is not None else None,
        )

    split_at = active_tokens if split_at is None else split_at
    for start in [*range(0, split_at, chunk), *range(split_at, active_tokens, chunk)]:
        stop = min(start + chunk, split_at if start < split_at else active_tokens)
        count = stop - start
        if computed_index is None:
            tokens = slice(start, stop)
            hidden_CH = hidden_NH[tokens]
            grad_hidden_CH = grad_hidden_NH[tokens] if grad_hidden_NH is not None else None
            if padding_N is not None:  # a C x H copy: padding rows reach neither the logits nor dlogits^T @ hidden
                hidden_CH = hidden_CH.masked_fill(padding_N[tokens, None], 0.0)
        else:
            tokens = computed_index[start:stop]
            hidden_CH = torch.index_select(hidden_NH, 0, tokens, out=gathered[0][:count])
            grad_hidden_CH = gathered[1][:count] if gathered[1] is not None else None
        target_C = target_N[tokens]
        scale_C = None if token_grad_scale_N is None else token_grad_scale_N[tokens]
        if vocab_major:  # [count, V] with strides (1, count): the transpose of a contiguous [V, count]
            logits = logits_buffer[: vocab * count].view(vocab, count).t()
        else:
            logits = logits_buffer[: count * vocab].view(count, vocab)
        # logits in the input dtype, bias fused into the GEMM like F.linear
        if bias_V is None:
            torch.mm(hidden_CH, weight_t_HV, out=logits)
        else:
            torch.addmm(bias_V, hidden_CH, weight_t_HV, out=logits)
        # in the input dtype, as eager's `logits * s` or `logits / d` (bf16 rounds the result)
        scale_logits(logits, logit_scale, logit_divisor, in_place=True)
        for block_start in range(0, count, block):
            rows = slice(block_start, min(block_start + block, count))
            if low_precision:
                work = work_BV[: rows.stop - rows.start]
                work.copy_(logits[rows])  # upcast to fp32
            else:
                work = logits[rows]
            tanh = tanh_BV[: rows.stop - rows.start] if softcap is not None else None
            _softmax_block(
                work, tanh, target_C[rows], loss_C[rows], lse_C[rows],
                ignore_index=ignore_index, smoothing=smoothing, softcap=softcap, dlogits=with_grads,
            )
            if with_grads:
                # row scale (0 at ignored tokens) times the unscaled dlogits; low precision then rounds the product
                # to the input dtype, as eager autograd rounds dlogits before its matmuls
                if scale_rows:
                    valid_B1 = (target_C[rows] != ignore_index)[:, None]
                    work.mul_(torch.where(valid_B1, scale_C[rows].to(work.dtype)[:, None], 0.0))
                if padding_N is not None:  # (non-finite weights make even a zero row's logits NaN)
                    work.masked_fill_(padding_N[tokens][rows, None], 0.0)
                if low_precision:
                    # a separate copy: torch.mul(..., out=<bf16>) measured 4.5x slower than mul_ + copy_
                    logits[rows].copy_(work)
                if grad_bias_acc_V is not None:
                    grad_bias_acc_V.add_(work.sum(dim=0))
        loss_out_N[tokens] = loss_C[:count]
        lse_out_N[tokens] = lse_C[:count]
        if not with_grads:
            continue
        dlogits = logits
        # d(x * s) / dx = s, d(x / d) / dx = 1 / d: eager multiplies by s or divides by d the (rounded, in low
        # precision) dlogits in the input dtype
        scale_logits(dlogits, logit_scale, logit_divisor, in_place=True)
        if grad_hidden_CH is not None:
            torch.mm(dlogits, weight_VH, out=grad_hidden_CH)
            if computed_index is not None:
                grad_hidden_NH.index_copy_(0, tokens, grad_hidden_CH)
        if grad_weight_acc_VH is not None:
            first_chunk = start == 0  # the accumulator is still unwritten
            if weight_grad_partial is None:  # fp32 / fp64: accumulate inside the GEMM
                if first_chunk:
                    torch.mm(dlogits.t(), hidden_CH, out=grad_weight_acc_VH)
                else:
                    grad_weight_acc_VH.addmm_(dlogits.t(), hidden_CH)
            else:
                _add_low_precision_weight_grad(
                    grad_weight_acc_VH, dlogits, hidden_CH, *weight_grad_partial, overwrite=first_chunk
                )


def _softmax_block(work, tanh, target_B, loss_out_B, lse_out_B, *, ignore_index, smoothing, softcap, dlogits):
    """Per-token loss and lse of a block of fp32 logits; with ``dlogits``, turns ``work`` into the *unscaled*
    dlogits ``(softmax - (1 - eps) onehot - eps / V) * softcap'`` (the caller applies the row scale)."""
    vocab = work.shape[1]
    valid_B = target_B != ignore_index
    safe_target_B1 = torch.where(valid_B, target_B, 0).unsqueeze(1)
    if softcap is not None:
        torch.div(work, softcap, out=tanh).tanh_()
        torch.mul(tanh, softcap, out=work)
    max_B = work.amax(dim=1)
    target_logit_B = work.gather(1, safe_target_B1).squeeze(1)
    mean_logit_B = work.sum(dim=1) / vocab if smoothing else None
    if work.stride(1) == 1:
        # The fused in-place softmax (max, exp-sum, normalize) is ~3x faster on CPU than amax/sub/exp/sum passes.
        torch._softmax(work, 1, False, out=work)
    else:  # vocab-major: torch's softmax over a strided axis measured ~1.7x slower than these 4 passes
        work.sub_(max_B.unsqueeze(1)).exp_()
        work.div_(work.sum(dim=1, keepdim=True))
    # log(sum exp(z - max)) from the target's probability p_t = exp(z_t - max) / sum, without another pass over
    # the block: loss = -log p_t exactly (no cancellation), and lse = z_t - log p_t. Where p_t is too small to
    # carry full precision (below 1e-30, far from fp32 denormals), the row's largest probability (= 1 / sum
    # within an ulp) gives log(sum) instead.
    p_target_B = work.gather(1, safe_target_B1).squeeze(1)
    tiny_B = p_target_B < _TINY_PROBABILITY
    log_p_target_B = torch.log(p_target_B.clamp_min(_TINY_PROBABILITY))
    log_sumexp_B = (target_logit_B - max_B) - log_p_target_B
    nll_B = -log_p_target_B
    if bool(tiny_B.any()):
        rows = tiny_B.nonzero().squeeze(1)
        log_sumexp_B[rows] = -torch.log(work[rows].amax(dim=1))
        nll_B[rows] = log_sumexp_B[rows] + (max_B[rows] - target_logit_B[rows])
    lse_out_B.copy_(max_B + log_sumexp_B)
    loss_B = (1.0 - smoothing) * nll_B
    if smoothing:  # eps * (lse - mean z)
        loss_B = loss_B + smoothing * (log_sumexp_B + (max_B - mean_logit_B))
    loss_out_B.copy_(torch.where(valid_B, loss_B, 0.0))
    if not dlogits:
        return
    if smoothing:
        work.sub_(smoothing / vocab)
    work.scatter_add_(1, safe_target_B1, torch.full_like(p_target_B, -(1.0 - smoothing)).unsqueeze(1))
    if softcap is not None:
        # d(c tanh(x / c)) / dx = 1 - tanh^2
        tanh.mul_(tanh)
        torch.addcmul(work, work, tanh, value=-1.0, out=work)


class _SplitAccumulator:
    """The fp32 [V, H] weight-gradient accumulator of a low-precision weight, half of it inside the gradient.

    The [V, H] gradient in the weight's dtype (e bytes, 2 for bf16/fp16) is allocated up front and its storage
    holds the fp32 accumulator of rows [0, R), R = V * e / 4 = V / 2; rows [R, V) get an fp32 buffer of their
    own. At the end rows [0, R) are narrowed to the weight dtype in place, front to back through a small staging buffer (the
    narrow element i lands at byte e * i, at or before the fp32 element i it came from: nothing is overwritten
    before it is read), and rows [R, V) are cast into the rest. Peak: V * H * 4 bytes for accumulator and gradient
    together, not V * H * (4 + e), e.g. 256 MiB instead of 384 at V = 65536, H = 1024 in bf16."""

    def __init__(self, vocab: int, hidden: int, dtype: torch.dtype, device, *, zero: bool = True):
        """``zero=False`` leaves the accumulator unwritten: the caller's first add_rows of every row must then
        pass ``overwrite=True``."""
        self.grad_VH = torch.empty(vocab, hidden, dtype=dtype, device=device)
        assert self.grad_VH.element_size() == 2, "low precision means 2-byte floats here"
        self.inner_rows = (vocab * hidden // 2) // hidden if hidden else 0
        flat = self.grad_VH.view(-1)[: 2 * self.inner_rows * hidden]  # an even number of 2-byte elements
        self.inner_RH = flat.view(torch.float32).view(self.inner_rows, hidden)
        self.outer_RH = torch.empty(vocab - self.inner_rows, hidden, dtype=torch.float32, device=device)
        if zero:
            self.inner_RH.zero_()
            self.outer_RH.zero_()

    def add_rows(self, v0: int, v1: int, values_RH: Tensor, *, overwrite: bool = False) -> None:
        """rows [v0, v1) += values_RH (fp32); with ``overwrite``, rows [v0, v1) = values_RH."""
        split = self.inner_rows
        for rows_RH, lo, hi in ((self.inner_RH, 0, split), (self.outer_RH, split, self.grad_VH.shape[0])):
            a, b = max(v0, lo), min(v1, hi)
            if a < b:
                dest, values = rows_RH[a - lo:b - lo], values_RH[a - v0:b - v0]
                if overwrite:
                    dest.copy_(values)
                else:
                    dest.add_(values)

    def finish(self, staging_elements: int = _WEIGHT_GRAD_STAGING_BYTES // 4) -> Tensor:
        inner = self.inner_RH.view(-1)
        narrow = self.grad_VH.view(-1)
        staging = torch.empty(min(staging_elements, max(inner.numel(), 1)), dtype=torch.float32,
                              device=inner.device)
        for a in range(0, inner.numel(), staging.numel()):
            b = min(a + staging.numel(), inner.numel())
            staging[: b - a].copy_(inner[a:b])
            narrow[a:b].copy_(staging[: b - a])
        self.grad_VH[self.inner_rows:].copy_(self.outer_RH)
        self.inner_RH = self.outer_RH = None
        return self.grad_VH


def _add_low_precision_weight_grad(grad_weight_acc_VH, dlogits_CV, hidden_CH, partial_SH, staging_RH, *,
                                   overwrite=False):
    """grad_weight_acc_VH (a _SplitAccumulator) += dlogits_CV^T @ hidden_CH (``overwrite``: =), by vocabulary
    slices of a bf16 GEMM."""
    vocab = dlogits_CV.shape[1]
    for v0 in range(0, vocab, partial_SH.shape[0]):
        v1 = min(v0 + partial_SH.shape[0], vocab)
        partial = partial_SH[: v1 - v0]
        torch.mm(dlogits_CV[:, v0:v1].t(), hidden_CH, out=partial)
        for r0 in range(0, v1 - v0, staging_RH.shape[0]):
            r1 = min(r0 + staging_RH.shape[0], v1 - v0)
            staged = staging_RH[: r1 - r0]
            staged.copy_(partial[r0:r1])
            grad_weight_acc_VH.add_rows(v0 + r0, v0 + r1, staged, overwrite=overwrite)


def _finish(loss_N, lse_N, grad_hidden_NH, grad_weight_acc_VH, grad_bias_acc_V, weight_VH, bias_V):
    if isinstance(grad_weight_acc_VH, _SplitAccumulator):
        grad_weight_VH = grad_weight_acc_VH.finish()
    else:
        grad_weight_VH = None if grad_weight_acc_VH is None else grad_weight_acc_VH.to(weight_VH.dtype)
    grad_bias_V = None if grad_bias_acc_V is None else grad_bias_acc_V.to(bias_V.dtype)
    return loss_N, lse_N, grad_hidden_NH, grad_weight_VH, grad_bias_V
