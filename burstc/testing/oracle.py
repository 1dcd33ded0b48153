"""The equivalence oracle (a compiled training step vs eager on one device: the loss and every parameter
gradient; NaN patterns must match and NaN never passes) and the one tolerance table every test reads.

- :func:`assert_same_training_step`: ``burstc.compile`` on this process vs eager, same device and dtype;
- :func:`assert_equivalent`: ``burstc.compile(model, mesh)`` on P gloo ranks vs single-process eager;
- :data:`TOLERANCES` / :func:`tolerance`: the allowed error per dtype and per quantity compared.
"""
from __future__ import annotations

import math

from dataclasses import dataclass
from typing import Any, Callable

import torch

UNIT_ROUNDOFF = {torch.float32: 2.0**-24, torch.bfloat16: 2.0**-8, torch.float16: 2.0**-11}
_FP32_U, _BF16_U, _FP16_U = UNIT_ROUNDOFF[torch.float32], UNIT_ROUNDOFF[torch.bfloat16], UNIT_ROUNDOFF[torch.float16]


@dataclass(frozen=True)
class Tolerance:
    """``rtol`` and ``atol`` of one quantity; what they scale is the quantity's (see :data:`TOLERANCES`)."""

    rtol: float
    atol: float
    reason: str


# Quantities and how their check reads rtol / atol (e = expected, a = actual):
#   loss, param_grad                  compiled vs eager on one device: max|a - e| <= rtol * max|e|
#   sharded_loss, sharded_param_grad  P ranks vs one-device eager: max|a - e| <= rtol * max(max|e|, floor); the
#                                     gradients' floor is SHARDED_GRAD_FLOOR of the largest gradient
#   attention_out/lse/dq/dk/dv        ring attention vs fp32 one-device SDPA: max|a - e| <= atol + rtol * max|e|
#   attention_stand_in_delta          a stand-in output's delta vs the real one: torch.testing.assert_close
#   attention_block_grads             block_attention_backward vs the CPU flash backward: assert_close
#   fused_loss                        chunked linear+CE vs fp64 oracle: |a - e| <= atol * max(1, max|e|) + rtol * |e|
#   fused_loss_grad                   per entry |a - e| <= atol * sum_k |term_k| + rtol * |e| (a dot product's
#                                     forward-error bound: the gradients cancel, so max|e| is no scale)
#   triton_fused_loss                 Triton kernels vs oracle: per token atol * max(1, max|logit|) + rtol * |e|
#   triton_fused_loss_grad            as fused_loss_grad (low precision adds 2u * max|logit| per term: flipped
#                                     rounding of a logit; see tests/test_linear_cross_entropy_triton.py)
_ATTENTION = ("attention_out", "attention_lse", "attention_dq", "attention_dk", "attention_dv")
_ATTENTION_REASONS = {
    torch.float32: "fp32 everywhere; the ring only reorders the softmax sums (observed ~1e-6)",
    torch.bfloat16: "each block output leaves the CPU kernel in bf16 before the fp32 merge, and out/dq/dk/dv are "
                    "rounded to bf16 at the end (observed <=1e-2 on magnitudes ~1-3; one-device bf16 SDPA ~1e-2)",
    torch.float16: "same error sources as bf16, 8x finer rounding",
}
_ATTENTION_BOUNDS = {torch.float32: 1e-5, torch.bfloat16: 2e-2, torch.float16: 4e-3}

TOLERANCES: dict[tuple[torch.dtype, str], Tolerance] = {
    (torch.float32, "loss"): Tolerance(1e-5, 0.0, "the fused loss reorders the vocab reduction into chunks: a few ulps"),
    (torch.float32, "param_grad"): Tolerance(1e-5, 0.0, "as the loss: chunked vocab reductions, a few ulps of the max"),
    (torch.bfloat16, "loss"): Tolerance(2e-2, 0.0, "eager rounds dlogits to bf16 once, the fused op per chunk: ~2 ulps"),
    (torch.bfloat16, "param_grad"): Tolerance(2e-2, 0.0, "bf16 dlogits rounded per chunk, then fp32 accumulation"),
    (torch.float32, "sharded_loss"): Tolerance(1e-5, 0.0, "P partial losses summed in another order: a few ulps"),
    (torch.float32, "sharded_param_grad"): Tolerance(1e-5, 0.0, "the ring merges P partial softmaxes: a few ulps"),
    (torch.bfloat16, "sharded_loss"): Tolerance(3e-2, 0.0, "every ring block output is rounded to bf16 before its "
                                                           "fp32 merge (above the one-device 2e-2)"),
    (torch.bfloat16, "sharded_param_grad"): Tolerance(3e-2, 0.0, "bf16 ring block outputs merged in fp32, as the loss"),
    **{(dtype, quantity): Tolerance(bound, bound, _ATTENTION_REASONS[dtype])
       for dtype, bound in _ATTENTION_BOUNDS.items() for quantity in _ATTENTION},
    (torch.float32, "attention_stand_in_delta"): Tolerance(1e-6, 1e-6, "exact up to fp32 rounding"),
    (torch.bfloat16, "attention_stand_in_delta"): Tolerance(1e-2, 2e-2, "the stand-in output is rounded to bf16"),
    (torch.float32, "attention_block_grads"): Tolerance(1e-5, 1e-5, "the same fp32 math in another order"),
    (torch.bfloat16, "attention_block_grads"): Tolerance(3e-2, 3e-2, "bf16 inputs and outputs, fp32 inside"),
    (torch.float32, "fused_loss"): Tolerance(1e-5, 1e-5, "same fp32 math in another order: a few ulps per token, "
                                                         "summed over <= 64 tokens"),
    (torch.bfloat16, "fused_loss"): Tolerance(1e-5, 1e-5, "fp32 softmax on the same bf16 logits: fp32-exact"),
    (torch.float32, "fused_loss_grad"): Tolerance(1e-5, 64 * _FP32_U, "softmax entries carry ~u * |z - max| relative "
                                                                      "error (logit ranges up to ~30): 64 u per term"),
    (torch.bfloat16, "fused_loss_grad"): Tolerance(4 * _BF16_U, 3 * _BF16_U, "dlogits rounded to bf16 before the "
                                                   "hidden-grad matmul (u per term), result and oracle once each (2u)"),
    (torch.float32, "triton_fused_loss"): Tolerance(1e-5, 4 * _FP32_U, "a few fp32 ulps of the logits"),
    (torch.bfloat16, "triton_fused_loss"): Tolerance(1e-5, 2 * _BF16_U, "a logit rounded the other way (1 ulp) moves "
                                                                        "its token's loss by up to 2u |z|"),
    (torch.float16, "triton_fused_loss"): Tolerance(1e-5, 2 * _FP16_U, "as bf16: one flipped logit rounding, 2u |z|"),
    (torch.float32, "triton_fused_loss_grad"): Tolerance(160 * _FP32_U, 64 * _FP32_U, "a few fp32 ulps of the "
                                                         "logits, amplified like the CPU op's gradients"),
    (torch.bfloat16, "triton_fused_loss_grad"): Tolerance(4 * _BF16_U, 3 * _BF16_U, "as the CPU op's bf16 gradients "
                                                          "(plus the flip term added by the test)"),
    (torch.float16, "triton_fused_loss_grad"): Tolerance(4 * _FP16_U, 3 * _FP16_U, "as bf16, in fp16 units"),
}

# Sharded gradients are measured against at least this fraction of the largest reference gradient: a gradient
# that is zero in exact arithmetic (a key bias: softmax ignores a per-row shift) is rounding noise on both sides.
SHARDED_GRAD_FLOOR = 1e-3


def tolerance(dtype: torch.dtype, quantity: str) -> Tolerance:
    """The table's entry for ``quantity`` computed in ``dtype``; a KeyError names what is missing."""
    try:
        return TOLERANCES[dtype, quantity]
    except KeyError:
        raise KeyError(f"no tolerance for {quantity!r} in {dtype}") from None


def max_relative_error(actual: torch.Tensor | None, expected: torch.Tensor, floor: float = 0.0) -> float:
    """max |actual - expected| / max(max |expected|, floor) over the entries where ``expected`` is not NaN.

    inf when ``actual`` is missing or its shape differs; NaN (which fails every ``<=``) when the NaN patterns
    differ or an inf is compared with an inf."""
    if actual is None:
        return float("inf")
    actual, expected = actual.detach().double(), expected.detach().double()
    if actual.shape != expected.shape:
        return float("inf")
    if not torch.equal(torch.isnan(actual), torch.isnan(expected)):
        return float("nan")
    keep = ~torch.isnan(expected)
    if not keep.any():
        return 0.0
    scale = expected[keep].abs().max().clamp_min(max(floor, 1e-30))
    return float((actual[keep] - expected[keep]).abs().max() / scale)


def parameter_grads(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """A copy of every parameter gradient that is set, by parameter name."""
    return {name: p.grad.detach().clone() for name, p in model.named_parameters() if p.grad is not None}


def training_step_errors(loss, ref_loss, grads: dict, ref_grads: dict, grad_floor: float = 0.0) -> dict[str, float]:
    """Relative errors of the loss (key ``"loss"``) and of every parameter gradient (``"grad:<name>"``); a
    gradient on one side only is an infinite error.  ``grad_floor``: a fraction of the largest reference
    gradient below which no gradient's scale goes."""
    errors = {"loss": max_relative_error(loss, ref_loss)}
    # the largest finite reference entry: a NaN gradient elsewhere must not make every scale NaN
    floor = grad_floor * max((g[torch.isfinite(g)].abs().max().item() for g in ref_grads.values()
                              if torch.isfinite(g).any()), default=0.0)
    for name in sorted(set(ref_grads) | set(grads)):
        errors[f"grad:{name}"] = (max_relative_error(grads.get(name), ref_grads[name], floor)
                                  if name in ref_grads else float("inf"))
    return errors


def errors_above(errors: dict[str, float], loss_rtol: float, grad_rtol: float) -> dict[str, float]:
    """The errors that fail (NaN always fails): the loss against ``loss_rtol``, gradients against ``grad_rtol``."""
    return {k: e for k, e in errors.items() if not (e <= (loss_rtol if k == "loss" else grad_rtol))}


def _worst_first(bad: dict[str, float]) -> list[tuple[str, float]]:
    return sorted(bad.items(), key=lambda kv: -kv[1] if kv[1] == kv[1] else float("-inf"))[:8]


# -- the fp64 truth ---------------------------------------------------------------------------------------------
# A gradient whose fp32 comparison with eager fails is still right when its distance to the same step in fp64 is
# within TRUTH_FACTOR x eager's own distance, or within TRUTH_ULPS ulps (of the compared precision: fp32, or bf16
# for bf16 weights and autocast) of the largest true gradient: gradients that are zero in exact arithmetic (a key
# bias under softmax's shift invariance, q/k with one visible key) or that eager itself rounds badly (DiffLlama's
# lambdas) are judged by how close each side is to the truth, not by how close they are to each other.
TRUTH_FACTOR = 4.0
TRUTH_ULPS = 8


def fp64_truth(model, step: Callable, *, fallback: torch.dtype | None = None):
    """``step(copy)`` -> ``(loss, grads)`` on an fp64 copy of ``model``, or None when the model can't run in fp64.

    ``fallback`` (for cases run in a lower precision, e.g. fp32 for bf16 cases): when the fp64 step is not finite
    but the same step on a ``fallback`` copy is, that step is the truth.  Some model code is only finite in the
    precision it was written for: HF's eager attention adds a ``finfo(dtype).min`` mask and then runs its softmax
    in fp32, so in fp64 a query row that sees no key (left padding under a sliding window) becomes all ``-inf``
    after the cast and its output NaN — a NaN that none of the model's real precisions has.  fp32 is still ~2^16
    finer than bf16, far below any bf16 tolerance."""
    truth = _twin_step(model, step, torch.float64)
    if fallback is not None and truth is not None and not finite_step(*truth):
        lower = _twin_step(model, step, fallback)
        if lower is not None and finite_step(*lower):
            return lower
    return truth


def finite_step(loss, grads: dict) -> bool:
    """Are the loss (None: not checked) and every gradient finite?"""
    return (loss is None or bool(torch.isfinite(loss).all())) and all(bool(torch.isfinite(g).all())
                                                                      for g in grads.values())


def _twin_step(model, step: Callable, dtype: torch.dtype):
    import copy

    try:
        twin = copy.deepcopy(model).to(dtype)
        if hasattr(twin, "set_experts_implementation") and getattr(getattr(twin, "config", None),
                                                                   "_experts_implementation", None) not in (None, "eager"):
            # HF's grouped_mm / batched_mm experts take no fp64: the eager loop over the experts computes the same
            twin.set_experts_implementation("eager")
        twin.zero_grad(set_to_none=True)
        return step(twin)
    except Exception:  # noqa: BLE001 - an op without support for the twin's dtype: no truth from it
        return None


def errors_vs_truth(grads: dict, truth_grads: dict) -> dict[str, float]:
    """max |grad - truth| per parameter (inf where the shapes or the NaN patterns differ)."""
    errors = {}
    for name, truth in truth_grads.items():
        got = grads.get(name)
        if got is None or got.shape != truth.shape or not torch.equal(got.isnan(), truth.isnan()):
            errors[name] = math.inf
            continue
        diff = (got.double() - truth).abs()[~truth.isnan()]
        errors[name] = float(diff.max()) if diff.numel() else 0.0
    return errors


def truth_scale(truth_grads: dict) -> float:
    """The largest finite true gradient entry (of any gradients given: eager's where no truth exists)."""
    return max((float(g[torch.isfinite(g)].abs().max()) for g in truth_grads.values() if bool(torch.isfinite(g).any())),
               default=0.0)


def truth_allows(error_vs_truth: float, eager_error_vs_truth: float, scale: float,
                 dtype: torch.dtype = torch.float32) -> bool:
    """Is a gradient ``error_vs_truth`` away from the fp64 truth right (see TRUTH_FACTOR, TRUTH_ULPS)?"""
    ulp = torch.finfo(dtype).eps * scale
    # a NaN-pattern difference from the truth (inf) is never right, even where eager's differs too (inf <= inf)
    return math.isfinite(error_vs_truth) and error_vs_truth <= max(TRUTH_FACTOR * eager_error_vs_truth,
                                                                   TRUTH_ULPS * ulp)


def truth_fields(model, step: Callable, grads: dict, ref_grads: dict) -> dict:
    """For a result whose gradients failed the fp32 comparison: their and eager's distances to the fp64 truth."""
    truth = fp64_truth(model, step)
    if truth is None:
        return {}
    return {"grad_errors_vs_truth": errors_vs_truth(grads, truth[1]),
            "eager_grad_errors_vs_truth": errors_vs_truth(ref_grads, truth[1]), "truth_grad_scale": truth_scale(truth[1])}


def forgiven_by_truth(bad: dict[str, float], result: dict, dtype: torch.dtype = torch.float32,
                      runs: tuple[dict, ...] | None = None) -> dict[str, float]:
    """``bad`` without the gradients the fp64 truth shows right (:func:`truth_allows`) in every one of ``runs``
    (each with its ``grad_errors_vs_truth``; default ``result`` itself), against ``result``'s eager distances."""
    eager = result.get("eager_grad_errors_vs_truth")
    all_errors = [run.get("grad_errors_vs_truth") for run in (runs or (result,))]
    if not eager or not all(all_errors):
        return bad

    def right(name: str) -> bool:
        return name in eager and all(name in errors and truth_allows(errors[name], eager[name],
                                                                     result["truth_grad_scale"], dtype)
                                     for errors in all_errors)

    # a NaN error is a NaN pattern unlike eager's: never forgiven, whatever the truth says
    return {k: e for k, e in bad.items() if not (k.startswith("grad:") and e == e and right(k[5:]))}


# Where no fp64 truth exists (the model is not finite in fp64, e.g. a ``finfo(fp64).min`` mask that overflows a
# softmax), a gradient is still judged right when it carries nothing above rounding: eager's largest entry and the
# distance between the two sides both within TRUTH_ULPS ulps of the model's largest eager gradient.  Such a
# gradient is zero in exact arithmetic up to the rounding of the larger terms it is summed from; a wrong one
# (a missed term, a term counted twice) is off by a term, which a gradient this small cannot hide only when its
# terms are themselves below the noise: the same floor the truth rule grants.
def noise_level_grads(grads: dict, ref_grads: dict, dtype: torch.dtype = torch.float32) -> list[str]:
    """Names of the gradients at rounding-noise level (see above); NaN or a missing side never is."""
    noise = TRUTH_ULPS * torch.finfo(dtype).eps * truth_scale(ref_grads)  # eager's largest stands in for the truth's
    found = []
    for name, ref in ref_grads.items():
        got = grads.get(name)
        if got is None or got.shape != ref.shape or not bool(torch.isfinite(ref).all() and torch.isfinite(got).all()):
            continue
        if ref.numel() == 0 or (float(ref.abs().max()) <= noise
                                and float((got.double() - ref.double()).abs().max()) <= noise):
            found.append(name)
    return found


def forgiven_as_noise(bad: dict[str, float], runs: tuple[dict, ...]) -> dict[str, float]:
    """``bad`` without the gradients every one of ``runs`` lists in its ``noise_grads`` (set only where the fp64
    truth was missing)."""
    lists = [run.get("noise_grads") for run in runs]
    if not lists or any(names is None for names in lists):
        return bad
    common = set.intersection(*(set(names) for names in lists))
    return {k: e for k, e in bad.items() if not (k.startswith("grad:") and e == e and k[5:] in common)}


def assert_same_training_step(model, run, compiled_run, dtype=torch.float32):
    """``run(model)`` (eager) and ``compiled_run()`` return losses: compare the loss and all parameter gradients
    with the one-device tolerances for ``dtype``.  Returns ``(loss, ref_loss)``."""
    model.zero_grad(set_to_none=True)
    ref_loss = run(model)
    ref_loss.backward()
    ref_grads = parameter_grads(model)
    model.zero_grad(set_to_none=True)
    loss = compiled_run()
    loss.backward()
    grads = parameter_grads(model)
    loss_rtol, grad_rtol = tolerance(dtype, "loss").rtol, tolerance(dtype, "param_grad").rtol
    bad = errors_above(training_step_errors(loss, ref_loss, grads, ref_grads), loss_rtol, grad_rtol)
    assert not bad, (f"errors relative to max |reference| above loss {loss_rtol:g} / grad {grad_rtol:g} "
                     f"(nan = NaN mismatch, inf = missing or shape differs): {_worst_first(bad)}")
    return loss, ref_loss


def equivalence_task(rank: int, world_size: int, model_fn: Callable, inputs_fn: Callable, loss_fn: Callable,
                     options: dict, dtype: torch.dtype = torch.float32, mesh_shape: tuple[int, ...] | None = None,
                     mesh_dim_names: tuple[str, ...] | None = None) -> dict[str, Any]:
    """Run on every rank: eager reference on the full batch, then burstc on the mesh (1-D over the world, or
    ``mesh_shape`` with ``mesh_dim_names``); compare."""
    import burstc
    from torch.distributed.device_mesh import init_device_mesh

    torch._dynamo.reset()
    model = model_fn().to(dtype)
    inputs = inputs_fn()
    model.zero_grad(set_to_none=True)
    ref_loss = loss_fn(model, inputs)
    ref_loss.backward()
    ref_grads = parameter_grads(model)
    model.zero_grad(set_to_none=True)

    mesh = init_device_mesh("cpu", mesh_shape or (world_size,), mesh_dim_names=mesh_dim_names)
    cmodel = burstc.compile(model, mesh, **options)
    loss = loss_fn(cmodel, inputs)
    loss.backward()
    grads = parameter_grads(model)
    report = burstc.report(cmodel)
    errors = training_step_errors(loss, ref_loss, grads, ref_grads, SHARDED_GRAD_FLOOR)
    truth = {}
    if dtype == torch.float32 and errors_above(errors, tolerance(dtype, "sharded_loss").rtol,
                                               tolerance(dtype, "sharded_param_grad").rtol):

        def step(twin):  # the reference step again, in fp64 (only when the fp32 comparison fails)
            twin_loss = loss_fn(twin, inputs)
            twin_loss.backward()
            return twin_loss.detach(), parameter_grads(twin)

        truth = truth_fields(model, step, grads, ref_grads)
    return {
        **truth,
        "rank": rank, "errors": errors,
        "loss": float(loss), "ref_loss": float(ref_loss),
        "rewrites": [(r.kind, r.details.get("plan")) for r in report.rewrites],
        "rings": [r.details.get("ring") for r in report.rewrites if r.kind == "attention"],
        "skipped": [(s.kind, s.reason) for s in report.skipped],
        "skip_codes": [s.code for s in report.skipped],
        "attention_masks": [r.details.get("mask") for r in report.rewrites if r.kind == "attention"],
        "attention_casts": [r.details.get("cast_to") for r in report.rewrites if r.kind == "attention"],
        "hidden_rows": [r.details.get("hidden_rows") for r in report.rewrites if r.kind == "attention"],
        "padded_to": next((r.details.get("padded_to") for r in report.rewrites if r.kind == "shard"), None),
        "shard_details": next((r.details for r in report.rewrites if r.kind == "shard"), None),
        "report": str(report),
    }


def assert_equivalent(model_fn: Callable, inputs_fn: Callable, loss_fn: Callable, *, world_size: int,
                      group=None, dtype: torch.dtype = torch.float32, rtol: float | None = None,
                      tolerance_dtype: torch.dtype | None = None, expect_sharded: bool = True,
                      timeout: float = 300.0, mesh_shape: tuple[int, ...] | None = None,
                      mesh_dim_names: tuple[str, ...] | None = None, **options) -> list[dict]:
    """Check that ``burstc.compile(model_fn(), mesh, **options)`` on ``world_size`` gloo ranks gives
    every rank the single-device eager loss and parameter gradients.

    ``model_fn()`` builds the model (seed it: every rank and the reference must build the same),
    ``inputs_fn()`` the full batch, ``loss_fn(model, inputs)`` the loss; all three module-level
    functions (they are pickled to the workers).  ``group``: a :class:`burstc.testing.WorkerGroup`
    to reuse (default: the process-wide one for ``world_size``).  Tolerances: the table's sharded
    loss / gradient entries for ``tolerance_dtype`` (default ``dtype``; bf16 for fp32 parameters
    under bf16 autocast), or ``rtol`` for both.  ``expect_sharded``: also require that the shard
    pass rewrote the graph (no refusal).  ``mesh_shape`` / ``mesh_dim_names``: a mesh of several dims
    over the ``world_size`` ranks instead of the 1-D one.  Returns the per-rank results.
    """
    from burstc.testing.workers import get_worker_group

    group = group or get_worker_group(world_size)
    results = group.run(equivalence_task, model_fn, inputs_fn, loss_fn, options, dtype, mesh_shape, mesh_dim_names,
                        timeout=timeout)
    tolerance_dtype = tolerance_dtype or dtype
    loss_rtol = tolerance(tolerance_dtype, "sharded_loss").rtol if rtol is None else rtol
    grad_rtol = tolerance(tolerance_dtype, "sharded_param_grad").rtol if rtol is None else rtol
    for result in results:
        kinds = [k for k, _ in result["rewrites"]]
        if expect_sharded and world_size > 1 and "shard" not in kinds:
            raise AssertionError(f"rank {result['rank']}: the graph was not sharded: {result['skipped']}\n"
                                 f"{result['report']}")
        bad = forgiven_by_truth(errors_above(result["errors"], loss_rtol, grad_rtol), result, tolerance_dtype)
        if bad:
            raise AssertionError(f"rank {result['rank']}: errors above loss {loss_rtol:g} / grad {grad_rtol:g} "
                                 f"(nan = NaN mismatch, inf = missing): {_worst_first(bad)}\n"
                                 f"loss {result['loss']} vs eager {result['ref_loss']}\n{result['report']}")
    return results


def summed_over_ranks(grads: dict[str, torch.Tensor], group=None) -> dict[str, torch.Tensor] | None:
    """Each gradient summed over the ranks of ``group``: what a caller's own reduction makes of the gradients a
    ``reduce_grads=False`` compile leaves local.  None (and no collective that could hang) when the ranks hold
    gradients of different parameters."""
    import torch.distributed as dist

    names = sorted(grads)
    every = [None] * dist.get_world_size(group)
    dist.all_gather_object(every, names, group=group)
    if any(other != names for other in every):
        return None
    summed = {}
    for name in names:
        total = grads[name].clone()
        dist.all_reduce(total, group=group)
        summed[name] = total
    return summed
