"""``reduce_grads=False`` leaves parameter gradients local, for the caller to sum over the sequence ranks: the
ranks' gradients must sum to the single-device gradient whether a graph ran sharded (each rank's tokens' part)
or replicated (refused, or a call sent to the unsharded graph at run time: there the ``share_replicated_grads``
pass leaves each rank 1/P of the whole).  And with ``reduce_grads=True`` the pass changes nothing."""
from __future__ import annotations

import functools

import pytest
import torch

from burstc.testing import tolerance, zoo

PASS = "share_replicated_grads"
WORKER_RUN_TIMEOUT_S = 300


def _local_grads_sum_to_eager(rank, world_size, build, make_inputs, loss_fn, reduce_grads):
    import burstc
    from torch.distributed.device_mesh import init_device_mesh

    from burstc.testing.oracle import parameter_grads, summed_over_ranks, training_step_errors

    model, inputs = build(), make_inputs()
    ref_loss = loss_fn(model, inputs)
    ref_loss.backward()
    ref_grads = parameter_grads(model)
    model.zero_grad(set_to_none=True)
    mesh = init_device_mesh("cpu", (world_size,))
    compiled = burstc.compile(model, mesh, backend="aot_eager", reduce_grads=reduce_grads)
    loss = loss_fn(compiled, inputs)
    loss.backward()
    local = parameter_grads(model)
    grads = summed_over_ranks(local) if not reduce_grads else local
    report = burstc.report(compiled)
    errors = training_step_errors(loss.detach(), ref_loss.detach(), grads, ref_grads)
    return {"errors": errors, "shared": [r.node for r in report.rewrites_of(PASS)],
            "sharded": [r.sharding is not None for r in report.graph_records],
            "skip_codes": [s.code for s in report.skipped]}


def _check(results, tolerances=(tolerance(torch.float32, "sharded_loss").rtol,
                                tolerance(torch.float32, "sharded_param_grad").rtol)):
    loss_rtol, grad_rtol = tolerances
    for result in results:
        bad = {k: e for k, e in result["errors"].items() if not e <= (loss_rtol if k == "loss" else grad_rtol)}
        assert not bad, (bad, result)


@pytest.mark.multirank
@pytest.mark.parametrize("reduce_grads", [False, True])
def test_a_refused_graph_shares_its_gradients(workers, reduce_grads):
    # a max over the sequence: the shard pass refuses, the graph runs replicated on both ranks
    results = workers.get(2).run(_local_grads_sum_to_eager, zoo.max_pooled, zoo.titan_inputs, zoo.call_with_loss,
                                 reduce_grads)
    _check(results)
    for result in results:
        assert result["sharded"] == [False]
        assert result["shared"] == (["3 parameters"] if not reduce_grads else []), result["shared"]


@pytest.mark.multirank
def test_a_sharded_graph_is_left_alone(workers):
    results = workers.get(2).run(_local_grads_sum_to_eager, zoo.nanogpt_sdpa, zoo.nanogpt_inputs, zoo.nanogpt_loss,
                                 False)
    _check(results)
    assert all(r["sharded"] == [True] and r["shared"] == [] for r in results), results


@pytest.mark.multirank
def test_a_call_sent_to_the_unsharded_graph_shares_its_gradients(workers):
    """BLOOM: a batch with a hole in its padding runs the unsharded graph, the left-padded call after it the
    sharded one; the two calls' gradients accumulate, and their sum over the ranks is eager's."""
    pytest.importorskip("transformers")
    build = functools.partial(zoo.hf_arch_variant, "BloomConfig", "eager")
    results = workers.get(2).run(_local_grads_sum_to_eager, build, zoo.hf_arch_batch_inputs,
                                 zoo.hf_loss_padding_hole_then_left_padded, False)
    _check(results)
    for result in results:
        assert result["sharded"] == [True, False], result["sharded"]
        assert "pipeline.padding_hole_fallback" in result["skip_codes"]
        assert len(result["shared"]) == 1, result["shared"]
