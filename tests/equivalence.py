"""Helpers for tests that compare a compiled model with eager: loss and every parameter gradient."""
from __future__ import annotations

import torch

# Tolerances for burstc vs eager on the same device and dtype (relative to the reference's max abs).
# fp32: the fused loss reorders the vocab reduction into chunks; differences are a few ulps
# of the largest value.  bf16: eager rounds the logits' gradient to bf16 once over all tokens
# while the fused op rounds per chunk (then accumulates in fp32): a couple of bf16 ulps.
E2E_TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 2e-2}


def assert_close_rel(actual, expected, rel: float, what: str):
    assert actual is not None, f"{what}: got None"
    actual = actual.detach().double()
    expected = expected.detach().double()
    assert actual.shape == expected.shape, f"{what}: shape {tuple(actual.shape)} != {tuple(expected.shape)}"
    nan_a, nan_e = torch.isnan(actual), torch.isnan(expected)
    assert torch.equal(nan_a, nan_e), f"{what}: NaN pattern differs ({int(nan_a.sum())} vs {int(nan_e.sum())} NaNs)"
    a, e = actual[~nan_e], expected[~nan_e]
    if e.numel() == 0:
        return
    scale = e.abs().max().clamp_min(1e-30)
    err = (a - e).abs().max() / scale
    assert err <= rel, f"{what}: max error {err:.3g} (relative to max |ref| {scale:.3g}) > {rel:g}"


def grads_of(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {name: p.grad.detach().clone() for name, p in model.named_parameters() if p.grad is not None}


def assert_same_training_step(model, run, compiled_run, dtype=torch.float32):
    """``run(model)`` and ``compiled_run()`` return losses; compare loss and all parameter grads."""
    model.zero_grad(set_to_none=True)
    ref_loss = run(model)
    ref_loss.backward()
    ref_grads = grads_of(model)
    model.zero_grad(set_to_none=True)
    loss = compiled_run()
    loss.backward()
    grads = grads_of(model)
    rel = E2E_TOLERANCE[dtype]
    assert_close_rel(loss, ref_loss, rel, "loss")
    assert set(grads) == set(ref_grads), f"grads for {set(ref_grads) ^ set(grads)} missing"
    for name in ref_grads:
        assert_close_rel(grads[name], ref_grads[name], rel, f"grad of {name}")
    return loss, ref_loss
