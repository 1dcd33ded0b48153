"""``assert_equivalent``: burstc.compile(model, mesh) on P gloo ranks vs single-process eager."""
from __future__ import annotations

from typing import Any, Callable

import torch

# burstc on P ranks vs one-device eager (relative to the reference's max |value|).  fp32: the ring
# merges P partial softmaxes and the loss sums P partial losses in another order: a few ulps.
# bf16: every block output is rounded to bf16 before its fp32 merge.
TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 3e-2}


def _max_rel_error(actual: torch.Tensor, expected: torch.Tensor, floor: float = 0.0) -> float:
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


def _grads(model) -> dict[str, torch.Tensor]:
    return {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}


def equivalence_task(rank: int, world_size: int, model_fn: Callable, inputs_fn: Callable, loss_fn: Callable,
                     options: dict, dtype: torch.dtype = torch.float32) -> dict[str, Any]:
    """Run on every rank: eager reference on the full batch, then burstc on the mesh; compare."""
    import burstc
    from torch.distributed.device_mesh import init_device_mesh

    torch._dynamo.reset()
    model = model_fn().to(dtype)
    inputs = inputs_fn()
    model.zero_grad(set_to_none=True)
    ref_loss = loss_fn(model, inputs)
    ref_loss.backward()
    ref_grads = _grads(model)
    model.zero_grad(set_to_none=True)

    mesh = init_device_mesh("cpu", (world_size,))
    cmodel = burstc.compile(model, mesh, **options)
    loss = loss_fn(cmodel, inputs)
    loss.backward()
    grads = _grads(model)
    report = burstc.report(cmodel)
    errors = {"loss": _max_rel_error(loss, ref_loss)}
    # a gradient that is zero in exact arithmetic (a key bias: softmax ignores a per-row shift) is
    # rounding noise on both sides; measure every gradient against at least 1e-3 of the largest one
    floor = 1e-3 * max((g.abs().max().item() for g in ref_grads.values() if g.numel()), default=0.0)
    for name, ref in ref_grads.items():
        errors[f"grad:{name}"] = _max_rel_error(grads[name], ref, floor) if name in grads else float("inf")
    return {
        "rank": rank, "errors": errors, "loss": float(loss), "ref_loss": float(ref_loss),
        "rewrites": [(r.kind, r.details.get("plan")) for r in report.rewrites],
        "skipped": [(s.kind, s.reason) for s in report.skipped],
        "report": str(report),
    }


def assert_equivalent(model_fn: Callable, inputs_fn: Callable, loss_fn: Callable, *, world_size: int,
                      group=None, dtype: torch.dtype = torch.float32, rtol: float | None = None,
                      expect_sharded: bool = True, timeout: float = 300.0, **options) -> list[dict]:
    """Check that ``burstc.compile(model_fn(), mesh, **options)`` on ``world_size`` gloo ranks gives
    every rank the single-device eager loss and parameter gradients.

    ``model_fn()`` builds the model (seed it: every rank and the reference must build the same),
    ``inputs_fn()`` the full batch, ``loss_fn(model, inputs)`` the loss; all three module-level
    functions (they are pickled to the workers).  ``group``: a :class:`burstc.testing.WorkerGroup`
    to reuse (default: the process-wide one for ``world_size``).  ``expect_sharded``: also
    require that the shard pass rewrote the graph (no refusal).  Returns the per-rank results.
    """
    from burstc.testing import get_worker_group

    group = group or get_worker_group(world_size)
    results = group.run(equivalence_task, model_fn, inputs_fn, loss_fn, options, dtype, timeout=timeout)
    tol = TOLERANCE[dtype] if rtol is None else rtol
    for result in results:
        kinds = [k for k, _ in result["rewrites"]]
        if expect_sharded and world_size > 1 and "shard" not in kinds:
            raise AssertionError(f"rank {result['rank']}: the graph was not sharded: {result['skipped']}\n"
                                 f"{result['report']}")
        bad = {k: e for k, e in result["errors"].items() if not (e <= tol)}
        if bad:
            worst = sorted(bad.items(), key=lambda kv: -kv[1] if kv[1] == kv[1] else float("-inf"))[:8]
            raise AssertionError(f"rank {result['rank']}: errors above {tol:g} (nan = NaN mismatch): {worst}\n"
                                 f"loss {result['loss']} vs eager {result['ref_loss']}\n{result['report']}")
    return results
