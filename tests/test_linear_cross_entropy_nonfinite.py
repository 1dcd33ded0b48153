"""Non-finite values through the fused LM-head loss propagate exactly as in eager (issue 19: "NaN in weights or
inputs, propagate exactly as eager").

Eager differentiates every row, ignored ones included: an ignored row's dlogits are 0 x its softmax (NaN where its
logits are not finite), its weight-gradient terms 0 x its hidden state, its hidden gradient 0 x the weight. So NaN
(or inf) hidden states at ignored positions make eager's LM-head weight and bias gradients NaN (whole, or the
columns of the non-finite entries when a soft-cap keeps the logits finite), and a non-finite weight makes the
ignored rows' hidden gradients NaN. The reference here is eager itself (``F.linear`` in the input dtype, then
``F.cross_entropy`` on the fp32 logits): NaN and inf patterns must be equal; the finite entries are held to the op's
tolerances (``burstc.testing.TOLERANCES``, "fused_loss"/"fused_loss_grad") against the fp64 oracle of the same step
with the non-finite ignored rows zeroed, which is what eager's finite entries equal.

In bf16 the patterns are eager's on the same values in fp32: CPU's bf16 GEMM (oneDNN) may spill one row's NaN into
its neighbour's product (``zeros(37, 127)`` with row 1 NaN, ``@ W``: rows 0 and 1 NaN), a kernel artifact no
reordering of the rows can reproduce; the fused op keeps the NaN-carrying ignored rows in chunks of their own.
"""
from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from test_linear_cross_entropy_op import (
    TOLERANCES,
    assert_close_nan_aware,
    grad_output_for,
    gradient_term_magnitudes,
    loss_and_grads,
    make_inputs,
    oracle,
)

from burstc.kernels import linear_cross_entropy as kernel
from burstc.kernels.linear_cross_entropy import PADDING_TARGET, linear_cross_entropy_reference
from burstc.ops.linear_cross_entropy import linear_cross_entropy

POISONS = ("nan_hidden", "inf_hidden", "neg_inf_hidden", "nan_weight", "inf_weight", "nan_bias", "nan_valid_hidden")


def eager(hidden, weight, target, bias, **options):
    """What the user's model computes: F.linear in the input dtype, F.cross_entropy on the fp32 logits."""
    return linear_cross_entropy_reference(hidden, weight, target, bias, compute_dtype=torch.float32, **options)


def poisoned_inputs(case):
    """make_inputs plus one non-finite entry (or two) where ``case["poison"]`` says; ignored rows are drawn first."""
    hidden, weight, target, bias = make_inputs(
        case["num_tokens"], case["vocab"], case["hidden"], case["dtype"], has_bias=case["has_bias"],
        ignore_fraction=case["ignore_fraction"], seed=case["seed"])
    generator = torch.Generator().manual_seed(case["seed"] + 1)
    ignored = (target == -100).nonzero().squeeze(1)
    if ignored.numel() == 0:  # every poison at an ignored row needs one
        target[int(torch.randint(0, case["num_tokens"], (1,), generator=generator))] = -100
        ignored = (target == -100).nonzero().squeeze(1)
    value = {"nan": float("nan"), "inf": float("inf"), "neg": float("-inf")}[case["poison"][:3]]
    with torch.no_grad():
        if case["poison"].endswith("_hidden"):
            rows = ignored if case["poison"] != "nan_valid_hidden" else (target != -100).nonzero().squeeze(1)
            if rows.numel() == 0:
                rows = ignored
            for _ in range(case["entries"]):
                row = rows[int(torch.randint(0, rows.numel(), (1,), generator=generator))]
                hidden[row, int(torch.randint(0, case["hidden"], (1,), generator=generator))] = value
        elif case["poison"].endswith("_weight"):
            weight[int(torch.randint(0, case["vocab"], (1,), generator=generator)),
                   int(torch.randint(0, case["hidden"], (1,), generator=generator))] = value
        elif bias is not None:
            bias[int(torch.randint(0, case["vocab"], (1,), generator=generator))] = value
    return hidden, weight, target, bias


def assert_same_nonfinite_pattern(actual, expected, what):
    assert actual.shape == expected.shape, what
    assert torch.equal(torch.isnan(actual), torch.isnan(expected)), (
        f"{what}: NaN at {int(torch.isnan(actual).sum())} entries, eager {int(torch.isnan(expected).sum())}")
    assert torch.equal(torch.isinf(actual), torch.isinf(expected)), f"{what}: inf pattern differs"


def check_against_eager(hidden, weight, target, bias, *, chunk_size=None, impl="torch", **options):
    """The fused op's loss and gradients vs eager's: equal NaN/inf patterns, finite entries within tolerance."""
    loss, grads = loss_and_grads(linear_cross_entropy, hidden, weight, target, bias, chunk_size=chunk_size,
                                 impl=impl, **options)
    eager_loss, eager_grads = loss_and_grads(eager, hidden, weight, target, bias, **options)
    if hidden.dtype != torch.float32:  # the pattern without the bf16 GEMM's spills (see the module docstring)
        upcast = [None if t is None else t.detach().float().requires_grad_() for t in (hidden, weight, bias)]
        eager_loss, eager_grads = loss_and_grads(eager, upcast[0], upcast[1], target, upcast[2], **options)
    names = ("loss", "grad hidden", "grad weight", "grad bias")
    for name, actual, expected in zip(names, [loss, *grads], [eager_loss, *eager_grads]):
        if expected is not None:
            assert_same_nonfinite_pattern(actual.detach(), expected.detach(), name)
    # eager's finite entries hold no term of a non-finite ignored row (each is 0): the fp64 oracle of the step
    # with those rows zeroed gives them
    finite_rows = torch.isfinite(hidden.detach()).all(dim=-1) | (target != -100)
    clean = hidden.detach().where(finite_rows[:, None], 0.0).requires_grad_()
    if not (torch.isfinite(weight).all() and (bias is None or torch.isfinite(bias).all())):
        return loss, grads  # every row's logits change: the pattern is the whole check
    expected_loss, expected_grads = loss_and_grads(oracle, clean, weight, target, bias, **options)
    tol = TOLERANCES[hidden.dtype]
    scale = float(expected_loss.detach().abs().nan_to_num().max()) if expected_loss.numel() else 0.0
    finite = torch.isfinite(eager_loss.detach())
    assert_close_nan_aware(loss.detach()[finite], expected_loss.detach()[finite], rtol=tol.loss_rtol,
                           atol=tol.loss_atol * max(scale, 1.0), what="loss")
    magnitudes = gradient_term_magnitudes(clean, weight, target, bias, grad_output_for(loss), **options)
    for name, actual, expected, eager_grad, magnitude in zip(names[1:], grads, expected_grads, eager_grads,
                                                             magnitudes):
        if expected is None:
            continue
        finite = torch.isfinite(eager_grad)
        assert_close_nan_aware(actual[finite], expected[finite].to(actual.dtype), rtol=tol.grad_rtol,
                               atol=tol.grad_term_atol * magnitude[finite], what=name)
    return loss, grads


@st.composite
def nonfinite_cases(draw):
    dtype = draw(st.sampled_from([torch.float32, torch.bfloat16]))
    return dict(
        num_tokens=draw(st.sampled_from([1, 7, 37]) | st.integers(1, 45)),
        vocab=draw(st.sampled_from([5, 127]) | st.integers(2, 150)),
        hidden=draw(st.integers(3, 40)),
        dtype=dtype,
        has_bias=draw(st.booleans()),
        reduction=draw(st.sampled_from(["mean", "sum", "none"])),
        ignore_fraction=draw(st.sampled_from([0.3, 0.6, 1.0])),
        label_smoothing=draw(st.sampled_from([0.0, 0.0, 0.1])),
        softcap=draw(st.sampled_from([None, None, 2.0])),
        logit_scaling=draw(st.sampled_from([None, None, ("logit_scale", 0.3), ("logit_divisor", 6.0)])),
        chunk_size=draw(st.sampled_from([None, 1, 3]) | st.integers(1, 50)),
        # (a NaN in a valid row meets valid neighbours in one bf16 GEMM: fp32 only, see the module docstring)
        poison=draw(st.sampled_from(POISONS if dtype == torch.float32 else POISONS[:-1])),
        entries=draw(st.integers(1, 2)),
        # the accelerators' every-row path: one GEMM over every row, so on CPU in bf16 the spill again: fp32
        every_row=dtype == torch.float32 and draw(st.booleans()),
        seed=draw(st.integers(0, 2**16)),
    )


@settings(max_examples=60, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow])
@given(case=nonfinite_cases())
def test_nonfinite_values_propagate_as_in_eager(case):
    """Random odd shapes, fp32 and bf16, every loss option; the CPU path (ignored rows skipped unless they may
    carry a NaN) and the every-row path that accelerators take."""
    hidden, weight, target, bias = poisoned_inputs(case)
    options = dict(reduction=case["reduction"], label_smoothing=case["label_smoothing"], softcap=case["softcap"],
                   **dict([case["logit_scaling"]] if case["logit_scaling"] else []))
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(kernel, "_skips_rows", lambda device: not case["every_row"])
        check_against_eager(hidden, weight, target, bias, chunk_size=case["chunk_size"], **options)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("poison", ["nan", "inf"])
def test_nonfinite_ignored_rows_give_eagers_nan_weight_gradient(dtype, poison):
    """The issue's case: a -inf-masked, left-padded row gives NaN hidden states at positions whose labels are
    ignored. Eager's LM-head weight and bias gradients are then NaN (0 x NaN); the loss stays finite."""
    hidden, weight, target, bias = make_inputs(23, 61, 19, dtype, has_bias=True, ignore_fraction=0.0, seed=5)
    target[:6] = -100
    with torch.no_grad():
        hidden[2, 4] = float(poison)
    loss, grads = check_against_eager(hidden, weight, target, bias, chunk_size=7)
    assert torch.isfinite(loss) and grads[1].isnan().all() and grads[2].isnan().all()
    assert grads[0][2].isnan().all() and torch.isfinite(grads[0][6:]).all()


def test_softcapped_inf_row_gives_nan_columns_only():
    """A soft-cap keeps an inf hidden state's logits finite (tanh(inf) = 1): eager's dlogits of that ignored row are
    0, and only 0 x inf in dlogits^T @ hidden is NaN: the weight gradient's column of the inf entry."""
    hidden, weight, target, bias = make_inputs(17, 29, 11, torch.float32, has_bias=False, ignore_fraction=0.0, seed=2)
    target[3] = -100
    with torch.no_grad():
        hidden[3, 5] = float("inf")
    _, grads = check_against_eager(hidden, weight, target, None, softcap=3.0, chunk_size=4)
    nan_columns = grads[1].isnan().any(dim=0)
    assert nan_columns.tolist() == [h == 5 for h in range(11)] and grads[1][:, 5].isnan().all()


@pytest.mark.parametrize("reduction", ["mean", "sum"])
def test_all_ignored_batch_with_nan_rows(reduction):
    hidden, weight, target, bias = make_inputs(9, 13, 7, torch.float32, has_bias=True, ignore_fraction=1.0, seed=3)
    with torch.no_grad():
        hidden[4, 1] = float("nan")
    _, grads = check_against_eager(hidden, weight, target, bias, reduction=reduction)
    assert grads[1].isnan().all() and grads[0][4].isnan().all() and (grads[0][:4] == 0).all()


def test_nonfinite_weight_makes_ignored_rows_hidden_gradient_nan():
    """0 x a NaN weight column: eager's hidden gradient of an ignored (finite) row is NaN there."""
    hidden, weight, target, bias = make_inputs(12, 21, 9, torch.float32, has_bias=False, ignore_fraction=0.5, seed=4)
    with torch.no_grad():
        weight[7, 2] = float("nan")
    _, grads = check_against_eager(hidden, weight, target, None, chunk_size=5)
    assert grads[0][target == -100].isnan().any()


def test_finite_ignored_rows_are_still_skipped():
    """The rule costs nothing when every ignored row is finite: they are not computed (the point of skipping)."""
    hidden, weight, target, _ = make_inputs(40, 31, 8, torch.float32, has_bias=False, ignore_fraction=0.5, seed=6)
    ignored = target == -100
    assert kernel._rows_with_nonfinite_logits(hidden.detach(), weight.detach(), None, ignored, None) is None
    with torch.no_grad():
        hidden[ignored.nonzero()[0, 0], 3] = float("nan")
        big = hidden.detach().clone()
        big[ignored.nonzero()[1, 0]] = 1e38  # finite, but its logits overflow
    flagged = kernel._rows_with_nonfinite_logits(hidden.detach(), weight.detach(), None, ignored, None)
    assert flagged.nonzero().squeeze(1).tolist() == [int(ignored.nonzero()[0, 0])]
    flagged = kernel._rows_with_nonfinite_logits(big, weight.detach(), None, ignored, None)
    assert flagged.nonzero().squeeze(1).tolist() == ignored.nonzero()[:2, 0].tolist()


@pytest.mark.parametrize("every_row", [False, True])
def test_padding_rows_add_nothing_even_when_nan(monkeypatch, every_row):
    """Rows the shard pass appends (target PADDING_TARGET) are not the user's: with NaN hidden states they change
    no gradient, unlike an ignored row; the rest is eager on the rows without them."""
    monkeypatch.setattr(kernel, "_skips_rows", lambda device: not every_row)
    hidden, weight, target, bias = make_inputs(19, 23, 10, torch.float32, has_bias=True, ignore_fraction=0.3, seed=8)
    padded_target = target.clone()
    padded_target[-3:] = PADDING_TARGET
    with torch.no_grad():
        hidden[-2, 4] = float("nan")
    real = hidden.detach()[:-3].clone().requires_grad_()
    for reduction in ("mean", "sum"):
        loss, grads = loss_and_grads(linear_cross_entropy, hidden, weight, padded_target, bias, chunk_size=4,
                                     impl="torch", reduction=reduction)
        expected_loss, expected_grads = loss_and_grads(eager, real, weight, target[:-3], bias, reduction=reduction)
        assert_close_nan_aware(loss, expected_loss, rtol=1e-6, atol=1e-6, what="loss")  # (mean: no padding counted)
        assert torch.isfinite(grads[1]).all() and torch.isfinite(grads[2]).all()
        assert_close_nan_aware(grads[0][:-3], expected_grads[0], rtol=1e-5, atol=1e-6, what="grad hidden")
        assert_close_nan_aware(grads[1], expected_grads[1], rtol=1e-5, atol=1e-6, what="grad weight")
        assert_close_nan_aware(grads[2], expected_grads[2], rtol=1e-5, atol=1e-6, what="grad bias")
