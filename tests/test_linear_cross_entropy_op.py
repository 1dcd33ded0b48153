"""burstc.ops.linear_cross_entropy (CPU chunked path) against the materialized-logits oracle."""
from __future__ import annotations

import dataclasses
import math

import pytest
import torch
import torch.nn.functional as F
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch.utils._python_dispatch import TorchDispatchMode

import burstc.ops.linear_cross_entropy as lce_ops
from burstc.kernels.linear_cross_entropy import (
    chunked_linear_cross_entropy,
    default_chunk_size,
    linear_cross_entropy_reference,
)
from burstc.ops.linear_cross_entropy import linear_cross_entropy
from burstc.testing import tolerance


@dataclasses.dataclass(frozen=True)
class Tolerance:
    loss_rtol: float
    loss_atol: float  # times max(1, max |expected loss|)
    grad_rtol: float
    # atol per entry = grad_term_atol * sum_k |term_k| of that entry's sum (e.g. sum_v |dlogits_nv| |W_vh| for
    # grad_hidden[n, h]): the forward-error bound of a dot product whose terms carry a relative rounding error.
    # Gradients cancel (sum_v dlogits_nv = 0), so a bound relative to the result or its max is not enough.
    grad_term_atol: float


# Expected values come from the fp64 oracle evaluated at the same input-dtype-rounded logits.  The values and their
# reasons live in burstc.testing.oracle.TOLERANCES ("fused_loss", "fused_loss_grad").
def _op_tolerance(dtype: torch.dtype) -> Tolerance:
    loss, grad = tolerance(dtype, "fused_loss"), tolerance(dtype, "fused_loss_grad")
    return Tolerance(loss_rtol=loss.rtol, loss_atol=loss.atol, grad_rtol=grad.rtol, grad_term_atol=grad.atol)


TOLERANCES = {dtype: _op_tolerance(dtype) for dtype in (torch.float32, torch.bfloat16)}


def assert_close_nan_aware(actual, expected, *, rtol, atol, what=""):
    """|actual - expected| <= atol + rtol * |expected| on finite entries; NaN/inf must sit at the same places.

    ``atol`` may be a tensor (per-entry bound). A NaN on one side only always fails; NaN on both sides (e.g.
    all-ignored "mean") passes. torch.testing.assert_close(equal_nan=True) is close, but takes no per-entry atol.
    """
    actual = actual.detach().to(torch.float64)
    expected = expected.detach().to(torch.float64)
    assert actual.shape == expected.shape, f"{what}: shape {tuple(actual.shape)} != {tuple(expected.shape)}"
    nan_actual, nan_expected = torch.isnan(actual), torch.isnan(expected)
    assert torch.equal(nan_actual, nan_expected), (
        f"{what}: NaN mismatch ({int(nan_actual.sum())} vs {int(nan_expected.sum())})"
    )
    inf_actual, inf_expected = torch.isinf(actual), torch.isinf(expected)
    assert torch.equal(inf_actual, inf_expected), f"{what}: inf mismatch"
    assert torch.equal(actual[inf_actual], expected[inf_expected]), f"{what}: inf sign mismatch"
    finite = ~(nan_actual | inf_actual)
    atol = torch.as_tensor(atol, dtype=torch.float64).expand(actual.shape)[finite]
    error = (actual[finite] - expected[finite]).abs()
    bound = atol + rtol * expected[finite].abs()
    if error.numel():
        worst = int(torch.argmax(error - bound))
        assert bool((error <= bound).all()), (
            f"{what}: max excess {float((error - bound)[worst]):.3e} at error {float(error[worst]):.3e} "
            f"(bound {float(bound[worst]):.3e}); max error {float(error.max()):.3e}"
        )


def gradient_term_magnitudes(hidden, weight, target, bias, grad_output, *, reduction="mean", normalizer=None,
                             label_smoothing=0.0, softcap=None, logit_scale=None, logit_divisor=None):
    """sum_k |term_k| for every entry of grad_hidden, grad_weight, grad_bias (fp64, from the exact softmax).

    |dlogits_nv| <= s_n (p_nv + (1 - eps) [v = t_n] + eps / V) |softcap'(x_nv)| |a| with s_n = d total / d loss_n
    and a the logit scale (1 / d for a divisor d).
    """
    if logit_divisor is not None:
        logit_scale = 1.0 / logit_divisor
    vocab, hidden_size = weight.shape
    hidden_NH = hidden.detach().reshape(-1, hidden_size).double()
    target_N = target.reshape(-1)
    valid_N = target_N != -100
    logits = F.linear(hidden.detach(), weight.detach(), None if bias is None else bias.detach()).double()
    logits = logits.reshape(-1, vocab) * (1.0 if logit_scale is None else logit_scale)
    softcap_slope = torch.ones_like(logits) * (1.0 if logit_scale is None else abs(logit_scale))
    if softcap is not None:
        tanh = torch.tanh(logits / softcap)
        # + tanh^2 / 16: in fp32, 1 - tanh^2 carries ~4u absolute error however small it is (saturated logits);
        # the 64u fp32 term tolerance turns that into 1/16 of tanh^2 (bf16 rounding dominates it in bf16)
        logits, softcap_slope = softcap * tanh, (1 - tanh**2 + tanh**2 / 16) * softcap_slope
    if reduction == "none":
        scale_N = grad_output.double().reshape(-1)
    elif normalizer is not None:
        scale_N = torch.full_like(valid_N, 1.0 / float(normalizer.detach()), dtype=torch.float64)
    elif reduction == "mean":
        scale_N = torch.full_like(valid_N, 1.0 / max(int(valid_N.sum()), 1), dtype=torch.float64)
    else:
        scale_N = torch.ones_like(valid_N, dtype=torch.float64)
    scale_N = torch.where(valid_N, scale_N.abs(), 0.0)
    onehot = F.one_hot(torch.where(valid_N, target_N, 0), vocab).double()
    # p_nv carries the rounding of z_nv - max_n (|z - max| u relative) and of the GEMM behind z (|s| sum_h |h W| u,
    # two GEMMs blocked differently): with the 64u tolerance, 1 + (both) / 32 covers them; they matter where the
    # logit scale s stretches the logits
    gemm_NV = F.linear(hidden_NH.abs(), weight.detach().double().abs(),
                       None if bias is None else bias.detach().double().abs())
    spread_NV = 1 + ((logits - logits.amax(dim=1, keepdim=True)).abs()
                     + gemm_NV * (1.0 if logit_scale is None else abs(logit_scale))) / 32
    magnitude_NV = torch.softmax(logits, dim=1) * spread_NV + (1 - label_smoothing) * onehot + label_smoothing / vocab
    magnitude_NV = magnitude_NV * softcap_slope * scale_N[:, None]
    grad_hidden = (magnitude_NV @ weight.detach().double().abs()).reshape(hidden.shape)
    grad_weight = magnitude_NV.t() @ hidden_NH.abs()
    grad_bias = magnitude_NV.sum(0) if bias is not None else None
    return grad_hidden, grad_weight, grad_bias


def assert_grads_close(actual_grads, expected_grads, tol, term_magnitudes, names=("hidden", "weight", "bias")):
    for name, actual, expected, magnitude in zip(names, actual_grads, expected_grads, term_magnitudes):
        if expected is None:
            assert actual is None, name
            continue
        assert actual.dtype == expected.dtype and actual.shape == expected.shape, name
        assert_close_nan_aware(actual, expected, rtol=tol.grad_rtol, atol=tol.grad_term_atol * magnitude,
                               what=f"grad {name}")


def assert_grads_match(actual_grads, expected_grads, *, rtol, atol_of_max, names=("hidden", "weight", "bias")):
    """For two runs of the same fp32 computation (compiled vs eager, chunk sizes): tight, relative to the max."""
    for name, actual, expected in zip(names, actual_grads, expected_grads):
        if expected is None:
            assert actual is None, name
            continue
        scale = float(expected.detach().abs().max()) if expected.numel() else 0.0
        assert_close_nan_aware(actual, expected, rtol=rtol, atol=atol_of_max * scale, what=f"grad {name}")


def test_assert_helper_fails_on_nan_mismatch_and_large_errors():
    one = torch.tensor([1.0, 2.0])
    with pytest.raises(AssertionError, match="NaN mismatch"):
        assert_close_nan_aware(torch.tensor([1.0, float("nan")]), one, rtol=1.0, atol=1.0)
    with pytest.raises(AssertionError, match="NaN mismatch"):
        assert_close_nan_aware(one, torch.tensor([float("nan"), 2.0]), rtol=1.0, atol=1.0)
    with pytest.raises(AssertionError, match="max excess"):
        assert_close_nan_aware(one + 1e-3, one, rtol=1e-4, atol=1e-4)
    assert_close_nan_aware(torch.tensor([float("nan")]), torch.tensor([float("nan")]), rtol=0, atol=0)


# ---------------------------------------------------------------------------------------------------------------------
# data


def make_inputs(num_tokens, vocab, hidden, dtype, *, has_bias, ignore_fraction, seed, leading=None, logit_scale=3.0):
    generator = torch.Generator().manual_seed(seed)
    shape = (num_tokens,) if leading is None else leading
    hidden_t = torch.randn(*shape, hidden, generator=generator).to(dtype).requires_grad_()
    # std(logit) ~ logit_scale so the softmax is neither uniform nor one-hot
    weight = (torch.randn(vocab, hidden, generator=generator) * (logit_scale / math.sqrt(hidden))).to(dtype)
    weight.requires_grad_()
    bias = (torch.randn(vocab, generator=generator) * 0.5).to(dtype).requires_grad_() if has_bias else None
    target = torch.randint(0, vocab, shape, generator=generator)
    ignored = torch.rand(shape, generator=generator) < ignore_fraction
    if ignore_fraction >= 1.0:
        ignored[...] = True
    target = torch.where(ignored, torch.full_like(target, -100), target)
    return hidden_t, weight, target, bias


def grad_output_for(loss, seed=0):
    if loss.dim() == 0:
        return torch.ones((), dtype=torch.float32, device=loss.device)
    # "none": weight each token differently so per-token gradient scaling is exercised
    return (torch.rand(loss.shape, generator=torch.Generator().manual_seed(seed)) + 0.5).to(loss.device)


def loss_and_grads(fn, hidden, weight, target, bias, **kwargs):
    """(loss, [grad_hidden, grad_weight, grad_bias or None]) of sum(grad_output_for(loss) * loss)."""
    loss = fn(hidden, weight, target, bias, **kwargs)
    leaves = [t for t in (hidden, weight, bias) if t is not None]
    grads = list(torch.autograd.grad(loss, leaves, grad_output_for(loss).to(loss.dtype)))
    if bias is None:
        grads.append(None)
    return loss, grads


def oracle(hidden, weight, target, bias, **kwargs):
    return linear_cross_entropy_reference(hidden, weight, target, bias, compute_dtype=torch.float64, **kwargs)


# ---------------------------------------------------------------------------------------------------------------------
# property test against the oracle


@st.composite
def lce_cases(draw):
    num_tokens = draw(st.sampled_from([1, 7, 37]) | st.integers(1, 64))
    return dict(
        num_tokens=num_tokens,
        vocab=draw(st.sampled_from([5, 127, 1001]) | st.integers(2, 300)),
        hidden=draw(st.integers(3, 96)),
        dtype=draw(st.sampled_from([torch.float32, torch.bfloat16])),
        has_bias=draw(st.booleans()),
        reduction=draw(st.sampled_from(["mean", "sum", "none"])),
        ignore_fraction=draw(st.sampled_from([0.0, 0.3, 1.0])),
        label_smoothing=draw(st.sampled_from([0.0, 0.0, 0.1, 0.7])),
        softcap=draw(st.sampled_from([None, None, 2.0, 30.0])),
        logit_scaling=draw(st.sampled_from([None, None, None, ("logit_scale", 0.0625), ("logit_scale", 0.3),
                                            ("logit_scale", 2.5), ("logit_divisor", 3.0), ("logit_divisor", 0.7)])),
        chunk_size=draw(st.sampled_from([None, 1, 3, 16]) | st.integers(1, 70)),
        leading=draw(st.sampled_from([None, "batch"])) if num_tokens % 2 == 0 else None,
        seed=draw(st.integers(0, 2**16)),
    )


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(case=lce_cases())
def test_matches_oracle(case):
    leading = (2, case["num_tokens"] // 2) if case["leading"] else None
    hidden, weight, target, bias = make_inputs(
        case["num_tokens"], case["vocab"], case["hidden"], case["dtype"], has_bias=case["has_bias"],
        ignore_fraction=case["ignore_fraction"], seed=case["seed"], leading=leading,
    )
    options = dict(reduction=case["reduction"], label_smoothing=case["label_smoothing"], softcap=case["softcap"],
                   **dict([case["logit_scaling"]] if case["logit_scaling"] else []))
    loss, grads = loss_and_grads(linear_cross_entropy, hidden, weight, target, bias,
                                 chunk_size=case["chunk_size"], **options)
    expected_loss, expected_grads = loss_and_grads(oracle, hidden, weight, target, bias, **options)

    assert loss.dtype == torch.float32
    assert loss.shape == expected_loss.shape
    tol = TOLERANCES[case["dtype"]]
    scale = float(expected_loss.detach().abs().nan_to_num().max()) if expected_loss.numel() else 0.0
    assert_close_nan_aware(loss, expected_loss, rtol=tol.loss_rtol, atol=tol.loss_atol * max(scale, 1.0),
                           what="loss")
    all_ignored = bool((target == -100).all())
    if case["reduction"] == "mean" and all_ignored:
        assert torch.isnan(loss), "all-ignored mean must be 0/0 = NaN like eager"
    magnitudes = gradient_term_magnitudes(hidden, weight, target, bias, grad_output_for(loss), **options)
    assert_grads_close(grads, expected_grads, tol, magnitudes)


def test_matches_eager_cross_entropy_exactly_in_fp32_semantics():
    """The op's contract is eager F.cross_entropy(F.linear(h, W, b).float(), t): check against eager itself."""
    hidden, weight, target, bias = make_inputs(45, 301, 40, torch.bfloat16, has_bias=True, ignore_fraction=0.2,
                                               seed=3)
    eager = F.cross_entropy(F.linear(hidden, weight, bias).float(), target)
    fused = linear_cross_entropy(hidden, weight, target, bias, chunk_size=8)
    assert_close_nan_aware(fused, eager, rtol=2e-6, atol=2e-6, what="loss vs eager")
    eager_grads = torch.autograd.grad(eager, (hidden, weight, bias))
    fused_grads = torch.autograd.grad(fused, (hidden, weight, bias))
    magnitudes = gradient_term_magnitudes(hidden, weight, target, bias, grad_output_for(fused))
    assert_grads_close(fused_grads, eager_grads, TOLERANCES[torch.bfloat16], magnitudes)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("option, factor", [("logit_scale", 0.0625), ("logit_scale", 0.3), ("logit_divisor", 3.0),
                                            ("logit_divisor", 6.0)])
def test_logit_scale_and_divisor_match_eager(dtype, option, factor):
    """Cohere scales the logits in the model's dtype before the loss (``logits * s``), Granite divides them
    (``logits / logits_scaling``): the loss equals eager's on the same rounded results, the gradients eager's
    and the fp64 oracle's (at the same rounded logits) within the dtype's tolerance."""
    hidden, weight, target, bias = make_inputs(45, 301, 40, dtype, has_bias=True, ignore_fraction=0.2, seed=4)
    logits = F.linear(hidden, weight, bias)
    eager = F.cross_entropy((logits * factor if option == "logit_scale" else logits / factor).float(), target)
    fused = linear_cross_entropy(hidden, weight, target, bias, chunk_size=8, **{option: factor})
    unscaled = linear_cross_entropy(hidden, weight, target, bias, chunk_size=8)
    assert_close_nan_aware(fused, eager, rtol=2e-6, atol=2e-6, what="loss vs eager")
    assert abs(float(fused) - float(unscaled)) > 1e-2  # the factor is applied, not dropped
    eager_grads = torch.autograd.grad(eager, (hidden, weight, bias))
    fused_grads = torch.autograd.grad(fused, (hidden, weight, bias))
    magnitudes = gradient_term_magnitudes(hidden, weight, target, bias, grad_output_for(fused), **{option: factor})
    assert_grads_close(fused_grads, eager_grads, TOLERANCES[dtype], magnitudes)
    oracle_loss, oracle_grads = loss_and_grads(oracle, hidden, weight, target, bias, **{option: factor})
    assert_close_nan_aware(fused, oracle_loss.float(), rtol=2e-6, atol=2e-6, what="loss vs oracle")
    assert_grads_close(fused_grads, oracle_grads, TOLERANCES[dtype], magnitudes)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
def test_scale_logits_divides_bit_for_bit(dtype):
    """A divisor is divided by, never inverted: ``x / 3`` and ``x * (1 / 3)`` differ in the last bit of some
    entries (fp32: about a third of them here), and eager computes the quotient."""
    from burstc.kernels.linear_cross_entropy import scale_logits

    x = torch.randn(4096, generator=torch.Generator().manual_seed(0), dtype=torch.float64).to(dtype) * 7
    assert torch.equal(scale_logits(x, None, 3.0), x / 3.0)
    assert torch.equal(scale_logits(x.clone(), None, 3.0, in_place=True), x / 3.0)
    assert torch.equal(scale_logits(x, 0.3, None), x * 0.3)
    assert scale_logits(x, None, None) is x
    if dtype != torch.bfloat16:  # (bf16 arithmetic runs in fp32 and rounds both to the same bf16 nearly always)
        assert not torch.equal(x * (1.0 / 3.0), x / 3.0)


@pytest.mark.parametrize("reduction", ["mean", "sum"])
def test_explicit_normalizer(reduction):
    hidden, weight, target, bias = make_inputs(37, 127, 24, torch.float32, has_bias=True, ignore_fraction=0.3, seed=5)
    normalizer = torch.tensor(91.5, requires_grad=True)  # e.g. a global (sequence-parallel) token count
    options = dict(reduction=reduction, label_smoothing=0.1, softcap=4.0)
    loss = linear_cross_entropy(hidden, weight, target, bias, normalizer=normalizer, chunk_size=5, **options)
    expected = oracle(hidden, weight, target, bias, normalizer=normalizer, **options)
    per_token_sum = oracle(hidden, weight, target, bias, reduction="sum", label_smoothing=0.1, softcap=4.0)
    assert_close_nan_aware(loss, per_token_sum / 91.5, rtol=1e-6, atol=1e-6, what="sum / normalizer")
    assert_close_nan_aware(loss, expected, rtol=1e-6, atol=1e-6, what="loss")
    grads = torch.autograd.grad(loss, (hidden, weight, bias, normalizer))
    expected_grads = torch.autograd.grad(expected, (hidden, weight, bias, normalizer))
    magnitudes = gradient_term_magnitudes(hidden, weight, target, bias, grad_output_for(loss),
                                          normalizer=normalizer, **options)
    assert_grads_close(grads[:3], expected_grads[:3], TOLERANCES[torch.float32], magnitudes)
    # d (S / n) / dn = -S / n^2
    assert_close_nan_aware(grads[3], -per_token_sum / 91.5**2, rtol=1e-6, atol=0, what="grad normalizer")
    assert_close_nan_aware(grads[3], expected_grads[3], rtol=1e-6, atol=0, what="grad normalizer vs oracle")
    # an integer normalizer (a count) is accepted and not differentiated
    count = (target != -100).sum() * 2
    loss_int = linear_cross_entropy(hidden, weight, target, bias, normalizer=count, **options)
    assert_close_nan_aware(loss_int, per_token_sum / float(count), rtol=1e-6, atol=1e-6, what="int normalizer")


def test_sum_without_normalizer_is_plain_sum_and_mean_counts_non_ignored():
    hidden, weight, target, bias = make_inputs(20, 50, 8, torch.float32, has_bias=False, ignore_fraction=0.5, seed=9)
    per_token = linear_cross_entropy(hidden, weight, target, reduction="none")
    assert bool((per_token[target == -100] == 0).all())
    total = linear_cross_entropy(hidden, weight, target, reduction="sum")
    mean = linear_cross_entropy(hidden, weight, target, reduction="mean")
    count = int((target != -100).sum())
    assert 0 < count < 20
    assert_close_nan_aware(total, per_token.sum(), rtol=1e-6, atol=1e-6, what="sum")
    assert_close_nan_aware(mean, per_token.sum() / count, rtol=1e-6, atol=1e-6, what="mean")


def test_chunk_sizes_that_do_not_divide_tokens_agree():
    hidden, weight, target, bias = make_inputs(37, 211, 16, torch.float32, has_bias=True, ignore_fraction=0.2, seed=2)
    reference_loss, reference_grads = loss_and_grads(linear_cross_entropy, hidden, weight, target, bias,
                                                     chunk_size=37)
    for chunk in (1, 5, 10, 36, 1000):
        loss, grads = loss_and_grads(linear_cross_entropy, hidden, weight, target, bias, chunk_size=chunk)
        assert_close_nan_aware(loss, reference_loss, rtol=1e-6, atol=1e-6, what=f"loss chunk={chunk}")
        assert_grads_match(grads, reference_grads, rtol=1e-5, atol_of_max=1e-5)


@pytest.mark.parametrize("vocab_major", [False, True])
@pytest.mark.parametrize("logit_scale, label_smoothing", [(3.0, 0.0), (3.0, 0.1), (80.0, 0.0), (80.0, 0.3)])
def test_fp32_logit_layouts_match_the_oracle(monkeypatch, vocab_major, logit_scale, label_smoothing):
    """fp32 on CPU keeps a chunk's logits vocab-major ([V, C] memory, its own softmax passes); the row-major
    layout stays for the rest. Both against the fp64 oracle: bias, ignored tokens, a short last chunk, per-token
    scales (reduction none), and target probabilities far below 1e-30 (logit std 80: the lse fallback)."""
    import burstc.kernels.linear_cross_entropy as kernel

    monkeypatch.setattr(kernel, "_VOCAB_MAJOR_FP32", vocab_major)
    hidden, weight, target, bias = make_inputs(45, 301, 24, torch.float32, has_bias=True, ignore_fraction=0.2,
                                               seed=5, logit_scale=logit_scale)
    for reduction in ("mean", "none"):
        options = dict(reduction=reduction, label_smoothing=label_smoothing)
        loss, grads = loss_and_grads(linear_cross_entropy, hidden, weight, target, bias, chunk_size=16, **options)
        expected_loss, expected_grads = loss_and_grads(oracle, hidden, weight, target, bias, **options)
        if logit_scale > 10 and reduction == "none":  # the fallback really ran: -log p_t > -log 1e-30
            assert float(expected_loss.max()) > 100
        assert_close_nan_aware(loss.double(), expected_loss, rtol=1e-5, atol=1e-5, what=f"loss {reduction}")
        assert_grads_match([g.double() for g in grads], expected_grads, rtol=1e-5, atol_of_max=1e-5)


def test_partial_requires_grad_and_no_grad():
    hidden, weight, target, bias = make_inputs(12, 33, 8, torch.float32, has_bias=True, ignore_fraction=0.0, seed=4)
    frozen_weight = weight.detach()
    loss = linear_cross_entropy(hidden, frozen_weight, target, bias.detach())
    (grad_hidden,) = torch.autograd.grad(loss, (hidden,))
    expected = oracle(hidden, frozen_weight, target, bias.detach())
    (expected_grad_hidden,) = torch.autograd.grad(expected, (hidden,))
    magnitudes = gradient_term_magnitudes(hidden, frozen_weight, target, bias, grad_output_for(loss))
    assert_grads_close([grad_hidden], [expected_grad_hidden], TOLERANCES[torch.float32], magnitudes[:1])
    with torch.no_grad():
        no_grad_loss = linear_cross_entropy(hidden, weight, target, bias)
    assert not no_grad_loss.requires_grad
    assert_close_nan_aware(no_grad_loss, expected, rtol=1e-6, atol=1e-6, what="no-grad loss")


def test_fp64_gradcheck():
    hidden, weight, target, bias = make_inputs(6, 11, 5, torch.float64, has_bias=True, ignore_fraction=0.3, seed=1)
    for reduction in ("mean", "none"):
        assert torch.autograd.gradcheck(
            lambda h, w, b: linear_cross_entropy(h, w, target, b, reduction=reduction, label_smoothing=0.2,
                                                 softcap=3.0, chunk_size=4),
            (hidden, weight, bias),
        )


# ---------------------------------------------------------------------------------------------------------------------
# validation


def test_invalid_inputs_raise_clear_errors():
    hidden, weight, target, bias = make_inputs(4, 9, 3, torch.float32, has_bias=True, ignore_fraction=0.0, seed=0)
    with pytest.raises(ValueError, match="hidden size mismatch"):
        linear_cross_entropy(hidden, torch.randn(9, 4), target)
    with pytest.raises(ValueError, match="target shape"):
        linear_cross_entropy(hidden, weight, target[:3])
    with pytest.raises(TypeError, match="integer class indices"):
        linear_cross_entropy(hidden, weight, target.float())
    with pytest.raises(ValueError, match="reduction"):
        linear_cross_entropy(hidden, weight, target, reduction="avg")
    with pytest.raises(ValueError, match="bias must have shape"):
        linear_cross_entropy(hidden, weight, target, torch.randn(8))
    with pytest.raises(TypeError, match="dtype"):
        linear_cross_entropy(hidden, weight.bfloat16(), target)
    with pytest.raises(NotImplementedError, match="per-class weights"):
        linear_cross_entropy(hidden, weight, target, class_weight=torch.ones(9))
    with pytest.raises(ValueError, match="impl"):
        linear_cross_entropy(hidden, weight, target, impl="cuda")
    with pytest.raises(ValueError, match="logit_scale"):
        linear_cross_entropy(hidden, weight, target, logit_scale=float("inf"))
    with pytest.raises(ValueError, match="logit_divisor"):
        linear_cross_entropy(hidden, weight, target, logit_divisor=0.0)
    with pytest.raises(ValueError, match="not both"):
        linear_cross_entropy(hidden, weight, target, logit_scale=2.0, logit_divisor=3.0)
    with pytest.raises(ValueError, match="normalizer"):
        linear_cross_entropy(hidden, weight, target, normalizer=torch.ones(2))
    with pytest.raises(ValueError, match="label_smoothing"):
        linear_cross_entropy(hidden, weight, target, label_smoothing=1.5)
    with pytest.raises(ValueError, match="softcap"):
        linear_cross_entropy(hidden, weight, target, softcap=0.0)
    with pytest.raises(ValueError, match="chunk_size"):
        linear_cross_entropy(hidden, weight, target, chunk_size=0)
    # int32 targets are accepted (converted to int64)
    assert_close_nan_aware(linear_cross_entropy(hidden, weight, target.int()),
                           linear_cross_entropy(hidden, weight, target), rtol=0, atol=0, what="int32 target")


# ---------------------------------------------------------------------------------------------------------------------
# torch.compile


@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
@pytest.mark.parametrize("reduction", ["mean", "none"])
def test_compiled_fullgraph_matches_eager_op(backend, reduction):
    hidden, weight, target, bias = make_inputs(26, 97, 12, torch.float32, has_bias=True, ignore_fraction=0.25,
                                               seed=11, leading=(2, 13))

    def loss_fn(h, w, t, b):
        loss = linear_cross_entropy(h, w, t, b, reduction=reduction, label_smoothing=0.1, softcap=5.0, chunk_size=6)
        return loss if reduction == "mean" else (loss * torch.linspace(0.5, 1.5, loss.numel()).view(loss.shape)).sum()

    eager_loss = loss_fn(hidden, weight, target, bias)
    eager_grads = torch.autograd.grad(eager_loss, (hidden, weight, bias))
    torch._dynamo.reset()
    compiled = torch.compile(loss_fn, backend=backend, fullgraph=True)
    compiled_loss = compiled(hidden, weight, target, bias)
    compiled_grads = torch.autograd.grad(compiled_loss, (hidden, weight, bias))
    assert_close_nan_aware(compiled_loss, eager_loss, rtol=1e-6, atol=1e-6, what="compiled loss")
    assert_grads_match(compiled_grads, eager_grads, rtol=1e-6, atol_of_max=1e-6)
    # the count normalizer is traced as a tensor: changing which tokens are ignored must not recompile or go stale
    other_target = target.clone()
    other_target[0, :5] = -100
    recompiled_loss = compiled(hidden, weight, other_target, bias)
    assert_close_nan_aware(recompiled_loss, loss_fn(hidden, weight, other_target, bias), rtol=1e-6, atol=1e-6,
                           what="compiled loss, other mask")


def test_compiled_graph_contains_only_the_fused_op():
    hidden, weight, target, bias = make_inputs(8, 40, 6, torch.float32, has_bias=False, ignore_fraction=0.0, seed=0)
    seen = []

    def spy_backend(graph_module, example_inputs):
        seen.extend(str(node.target) for node in graph_module.graph.nodes if node.op == "call_function")
        return graph_module.forward

    torch._dynamo.reset()
    torch.compile(lambda h, w, t: linear_cross_entropy(h, w, t), backend=spy_backend, fullgraph=True)(
        hidden, weight, target
    )
    assert any("linear_cross_entropy_with_grads" in target_name for target_name in seen), seen
    assert not any("cross_entropy" in name and "burstc" not in name for name in seen), seen


# ---------------------------------------------------------------------------------------------------------------------
# numerics: fp32 weight-grad accumulation in bf16


def _fp64_weight_grad(hidden, weight, target):
    weight64 = weight.detach().double().requires_grad_()
    # at the bf16-rounded logits (what every bf16 implementation sees), differentiated in fp64
    rounded = F.linear(hidden.detach(), weight.detach()).double()
    exact = F.linear(hidden.detach().double(), weight64)
    loss = F.cross_entropy(rounded + (exact - exact.detach()), target)
    (grad,) = torch.autograd.grad(loss, (weight64,))
    return grad


def test_bf16_weight_grad_accumulates_in_fp32_across_many_chunks():
    """Each chunk's bf16 partial product is rounded once and summed in fp32: the error stays at the level of one
    bf16 rounding of the exact gradient however many chunks there are; a bf16 accumulator grows with them."""
    num_tokens, vocab, hidden_size, chunk = 2048, 256, 32, 16  # 128 chunks
    hidden, weight, target, _ = make_inputs(num_tokens, vocab, hidden_size, torch.bfloat16, has_bias=False,
                                            ignore_fraction=0.0, seed=7)
    expected = _fp64_weight_grad(hidden, weight, target)
    loss = linear_cross_entropy(hidden, weight, target, chunk_size=chunk)
    (grad_weight,) = torch.autograd.grad(loss, (weight,))
    assert grad_weight.dtype == torch.bfloat16

    def relative_error(grad):
        return float((grad.double() - expected).norm() / expected.norm())

    # bf16 single-rounding tolerance, assert_close style: rtol = atol / max = unit roundoff u = 2^-8
    unit_roundoff = 2.0**-8
    scale = float(expected.abs().max())
    assert_close_nan_aware(grad_weight, expected, rtol=unit_roundoff, atol=unit_roundoff * scale,
                           what="chunked bf16 weight grad")
    single_rounding_error = relative_error(expected.bfloat16())
    # measured 1.21-1.24x (seeds 7-9): the dlogits and each chunk's partial are rounded once each
    assert relative_error(grad_weight) < 1.5 * single_rounding_error

    # the same chunk loop with a bf16 accumulator (the pitfall) fails both bounds: the test can fail
    grad_logits_scale = torch.full((num_tokens,), 1.0 / num_tokens)
    naive = torch.zeros_like(weight)
    for start in range(0, num_tokens, chunk):
        *_, grad_weight_chunk, _ = chunked_linear_cross_entropy(
            hidden.detach()[start:start + chunk], weight.detach(), target[start:start + chunk],
            token_grad_scale_N=grad_logits_scale[start:start + chunk], need_grad_hidden=False,
        )
        naive += grad_weight_chunk
    assert relative_error(naive) > 3.0 * single_rounding_error, (relative_error(naive), single_rounding_error)
    with pytest.raises(AssertionError):
        assert_close_nan_aware(naive, expected, rtol=unit_roundoff, atol=unit_roundoff * scale, what="naive")
    # eager bf16 (dlogits rounded to bf16, one GEMM over all tokens) for scale: the chunked op is close to it
    eager_loss = F.cross_entropy(F.linear(hidden, weight).float(), target)
    (eager_grad_weight,) = torch.autograd.grad(eager_loss, (weight,))
    assert relative_error(grad_weight) < 1.25 * relative_error(eager_grad_weight) < relative_error(naive)


# ---------------------------------------------------------------------------------------------------------------------
# memory and matmul count


class _TensorRecorder(TorchDispatchMode):
    """Records every op and the numel of every tensor it returns, looking inside burstc's custom ops too."""

    OP_BODIES = {
        torch.ops.burstc.linear_cross_entropy_with_grads.default: lce_ops._with_grads_impl,
        torch.ops.burstc.linear_cross_entropy_forward.default: lce_ops._forward_op_impl,
        torch.ops.burstc.linear_cross_entropy_backward.default: lce_ops._backward_op_impl,
    }

    def __init__(self):
        super().__init__()
        self.largest_numel = 0
        self.ops: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        self.ops.append(str(func.overloadpacket.__name__) if func.namespace != "burstc" else str(func))
        body = self.OP_BODIES.get(func)
        if body is not None:
            with self:  # run the op's python body under this mode so its internal allocations are seen
                out = body(*args, **kwargs)
        else:
            out = func(*args, **kwargs)
        for tensor in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(tensor, torch.Tensor):
                self.largest_numel = max(self.largest_numel, tensor.numel())
        return out


@pytest.mark.parametrize("reduction", ["mean", "none"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cpu_path_never_allocates_tokens_by_vocab(reduction, dtype):
    num_tokens, vocab, hidden_size, chunk = 256, 1000, 32, 32
    hidden, weight, target, bias = make_inputs(num_tokens, vocab, hidden_size, dtype, has_bias=True,
                                               ignore_fraction=0.1, seed=0)
    recorder = _TensorRecorder()
    with recorder:
        loss = linear_cross_entropy(hidden, weight, target, bias, reduction=reduction, chunk_size=chunk,
                                    label_smoothing=0.1, softcap=10.0)
        loss.sum().backward()
    assert any("burstc" in op for op in recorder.ops), recorder.ops[:10]
    assert recorder.largest_numel < num_tokens * vocab
    assert recorder.largest_numel <= max(chunk * vocab, vocab * hidden_size, num_tokens * hidden_size)
    # the recorder does see [N, V] tensors when they exist: the unfused reference trips it
    eager_recorder = _TensorRecorder()
    with eager_recorder:
        linear_cross_entropy_reference(hidden, weight, target, bias).backward()
    assert eager_recorder.largest_numel >= num_tokens * vocab


def _count_matmuls(ops):
    return sum(op in ("mm", "addmm", "addmm_") for op in ops)


def test_training_path_does_three_matmuls_per_chunk_and_inference_one():
    num_tokens, chunk = 40, 8  # 5 chunks
    hidden, weight, target, bias = make_inputs(num_tokens, 64, 16, torch.bfloat16, has_bias=True,
                                               ignore_fraction=0.0, seed=0)
    training = _TensorRecorder()
    with training:
        loss = linear_cross_entropy(hidden, weight, target, bias, chunk_size=chunk)
    assert "burstc.linear_cross_entropy_with_grads.default" in training.ops
    assert _count_matmuls(training.ops) == 3 * 5
    backward = _TensorRecorder()
    with backward:
        loss.backward()
    assert _count_matmuls(backward.ops) == 0  # backward only scales the precomputed gradients
    inference = _TensorRecorder()
    with inference, torch.no_grad():
        linear_cross_entropy(hidden, weight, target, bias, chunk_size=chunk)
    assert "burstc.linear_cross_entropy_forward.default" in inference.ops
    assert _count_matmuls(inference.ops) == 5


def test_default_chunk_size_memory_budget():
    # fp32: the 32 MiB budget holds 256 rows of V = 32768 fp32 logits; capped by the token count
    assert default_chunk_size(None, 32768, 256, torch.float32) == 256
    assert default_chunk_size(100, 32768, 256, torch.float32) == 100
    assert default_chunk_size(None, 32768, 256, torch.float32, softcap=True) == 256
    # fp32 grows to 512 rows while the buffer stays within the accumulator: V = 65536, H = 1024 -> 128 MiB
    assert default_chunk_size(None, 65536, 1024, torch.float32) == 512
    assert default_chunk_size(None, 10**7, 4, torch.float32) == 16  # floor for matmul efficiency
    # bf16 aims at 2048 rows within twice the accumulator: V = 32768, H = 256 -> 1024 rows (64 MiB, twice the
    # 32 MiB accumulator); V = 65536, H = 1024 -> 2048 rows (256 MiB next to a 256 MiB accumulator)
    assert default_chunk_size(None, 32768, 256, torch.bfloat16) == 1024
    assert default_chunk_size(None, 65536, 1024, torch.bfloat16) == 2048
    # with the token count known, the op stays within 1/8 of eager's 12 bytes per logit where it can: fp32,
    # 4096 x 1024 x 32768 -> 304 rows (144 MiB of gradients + 38 MiB <= 0.95 * 1536 / 8), bf16 -> 512 rows (the
    # accumulator shares the gradient's storage: 152 MiB with the block buffers + 30 MiB allows 480 rows, and the
    # 32 MiB budget's 512 rows are the floor); where the gradients alone exceed it (300 tokens)
    # the chunk falls back to the 32 MiB budget
    assert default_chunk_size(4096, 32768, 1024, torch.float32) == 304
    assert default_chunk_size(16384, 32768, 1024, torch.float32) == 512
    assert default_chunk_size(4096, 32768, 1024, torch.bfloat16) == 512
    assert default_chunk_size(16384, 65536, 1024, torch.bfloat16) == 2048
    assert default_chunk_size(300, 65536, 1024, torch.bfloat16) == 256
    # V = 262144, H = 64: twice the 64 MiB accumulator allows 256 rows; the 32 MiB budget alone would give 64
    assert default_chunk_size(None, 262144, 64, torch.bfloat16) == 256
    assert default_chunk_size(None, 262144, 4, torch.bfloat16) == 64  # the budget is the floor
    # a small vocabulary's budget (2048 rows of 4096 fp32 logits) is capped at the GEMM-friendly target
    assert default_chunk_size(2048, 4096, 128, torch.float32) == 512
    assert default_chunk_size(None, 2048, 256, torch.bfloat16) == 2048


@pytest.mark.parametrize("shape", [(300, 64, 1000), (257, 96, 5003)])
def test_autocast_computes_the_logits_eager_autocast_computes(shape):
    # under torch.autocast F.linear runs in bf16; the fused op casts hidden/weight alike, so it matches
    # eager autocast far more closely than the fp32 computation does (and its gradients stay fp32)
    n, h, v = shape
    g = torch.Generator().manual_seed(n)
    hidden = torch.randn(n, h, generator=g).requires_grad_()
    weight = (torch.randn(v, h, generator=g) * 0.1).requires_grad_()
    target = torch.randint(0, v, (n,), generator=g)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        eager = F.cross_entropy(F.linear(hidden, weight).float(), target)
        fused = lce_ops.linear_cross_entropy(hidden, weight, target)
    fp32 = F.cross_entropy(F.linear(hidden, weight), target)
    assert fused.dtype == torch.float32
    assert abs(float(fused - eager)) <= 0.1 * abs(float(fp32 - eager))
    grads_fused = torch.autograd.grad(fused, (hidden, weight))
    grads_eager = torch.autograd.grad(eager, (hidden, weight))
    for got, want in zip(grads_fused, grads_eager):
        assert got.dtype == torch.float32
        assert float((got - want).abs().max() / want.abs().max()) <= 1e-2


def test_backward_twice_with_retain_graph():
    # the backward scales the forward's gradient buffers in place only when it frees the graph
    hidden, weight, target, _ = make_inputs(37, 50, 16, torch.float32, has_bias=False, ignore_fraction=0.2, seed=4)
    loss = linear_cross_entropy(hidden, weight, target)
    first = torch.autograd.grad(loss * 2.0, (hidden, weight), retain_graph=True)
    second = torch.autograd.grad(loss * 3.0, (hidden, weight), retain_graph=True)
    third = torch.autograd.grad(loss, (hidden, weight))
    for a, b, c in zip(first, second, third):
        torch.testing.assert_close(a, 2.0 * c, rtol=1e-6, atol=0)
        torch.testing.assert_close(b, 3.0 * c, rtol=1e-6, atol=0)


@pytest.mark.parametrize("seed_scale", [0.5, 1.0])
def test_backward_hands_the_forward_buffer_to_grad(seed_scale):
    # no second [V, H] copy: .grad is the very buffer the forward filled, scaled in place (a seed of 1 skips the
    # scaling pass)
    hidden, weight, target, _ = make_inputs(64, 300, 32, torch.float32, has_bias=False, ignore_fraction=0.0, seed=5)
    seen = {}

    class Spy(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            if func is torch.ops.burstc.linear_cross_entropy_with_grads.default:
                seen["grad_weight_ptr"] = out[2].data_ptr()
            return out

    with Spy():
        loss = linear_cross_entropy(hidden, weight, target)
    (loss * seed_scale).backward()
    assert weight.grad.data_ptr() == seen["grad_weight_ptr"]
    expected = torch.autograd.grad(F.cross_entropy(F.linear(hidden, weight), target) * seed_scale, weight)[0]
    torch.testing.assert_close(weight.grad, expected, rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("vocab, hidden, dtype", [(7, 5, torch.bfloat16), (64, 48, torch.bfloat16),
                                                  (33, 1, torch.float16), (1, 3, torch.bfloat16)])
@pytest.mark.parametrize("first_overwrites", [False, True])
def test_split_accumulator_narrows_in_place(vocab, hidden, dtype, first_overwrites):
    # the fp32 accumulator of a bf16 weight gradient lives half inside the gradient's own storage; narrowing it in
    # place through a tiny staging buffer (many overlapping steps) must give exactly the fp32 sums, rounded once.
    # Unzeroed (the kernel's first chunk writes instead of adding): NaN garbage must be overwritten everywhere.
    from burstc.kernels.linear_cross_entropy import _SplitAccumulator

    accumulator = _SplitAccumulator(vocab, hidden, dtype, "cpu", zero=not first_overwrites)
    if first_overwrites:
        accumulator.inner_RH.fill_(float("nan"))
        accumulator.outer_RH.fill_(float("nan"))
    generator = torch.Generator().manual_seed(vocab * 31 + hidden)
    expected = torch.zeros(vocab, hidden)
    slices = [(0, vocab), (vocab // 3, vocab), (0, max(1, vocab // 2)), (vocab // 2, vocab // 2 + 1)]
    for index, (v0, v1) in enumerate(slices):
        values = torch.randn(v1 - v0, hidden, generator=generator)
        accumulator.add_rows(v0, v1, values, overwrite=first_overwrites and index == 0)
        expected[v0:v1] += values
    got = accumulator.finish(staging_elements=3)
    assert got.dtype == dtype and got.shape == (vocab, hidden)
    assert torch.equal(got, expected.to(dtype))
