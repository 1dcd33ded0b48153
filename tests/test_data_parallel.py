"""burstc beside data parallelism on a ("dp", "cp") mesh: each data-parallel replica trains its own batch as a
2-rank sequence-parallel ring, and DDP or FSDP2 over "dp" averages the replicas' gradients.  The result must
equal the single-device gradients averaged over the replicas' batches.  FSDP2 on submodules splits the model
into one graph per wrapped module (torch runs its hooks outside the graph): exact, replicated, and said so.
burstc.compile(DDP(model)) keeps one graph: Dynamo's DDPOptimizer, which cuts it per gradient bucket, is off."""
from __future__ import annotations

import copy
import warnings

import pytest
import torch

from burstc.testing import tolerance, zoo

pytestmark = pytest.mark.multirank

DP, CP = 2, 2


def _replica_batch(replica: int):
    g = torch.Generator().manual_seed(10 + replica)
    return torch.randint(0, 97, (1, 32), generator=g), torch.randint(0, 97, (1, 32), generator=g)


def _llama_of_several_buckets():
    """~6 MiB of fp32 parameters: DDP's 1 MiB buckets cut Dynamo's graph in ~6 pieces (DDPOptimizer) unless
    burstc turns that off."""
    from burstc.testing.zoo.titan import TitanLlama, TitanLlamaArgs, WithLoss

    torch.manual_seed(0)
    return WithLoss(TitanLlama(TitanLlamaArgs(dim=256, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=97,
                                              max_seq_len=64)))


def _data_parallel_task(rank, world_size, wrapping):
    import burstc
    from burstc.testing.oracle import SHARDED_GRAD_FLOOR, parameter_grads, training_step_errors
    from torch.distributed.device_mesh import init_device_mesh

    torch._dynamo.reset()
    mesh = init_device_mesh("cpu", (DP, CP), mesh_dim_names=("dp", "cp"))
    replica = mesh["dp"].get_local_rank()
    model = zoo.titan_llama() if wrapping != "ddp_then_compile" else _llama_of_several_buckets()
    reference = copy.deepcopy(model)
    ref_loss = None
    for other in range(DP):  # the replicas' mean loss gradient, on one device
        loss = zoo.call_with_loss(reference, _replica_batch(other))
        (loss / DP).backward()
        ref_loss = loss.detach() if other == replica else ref_loss
    ref_grads = parameter_grads(reference)

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        if wrapping == "ddp_then_compile":  # burstc.compile(DDP(model)): one graph, not one per gradient bucket
            from torch.nn.parallel import DistributedDataParallel

            wrapped = DistributedDataParallel(model, process_group=mesh["dp"].get_group(), bucket_cap_mb=1)
            compiled = step_model = burstc.compile(wrapped, mesh, seq_dims=("cp",), backend="aot_eager")
        elif wrapping == "ddp":
            from torch.nn.parallel import DistributedDataParallel

            compiled = burstc.compile(model, mesh, seq_dims=("cp",), backend="aot_eager")
            step_model = DistributedDataParallel(compiled, process_group=mesh["dp"].get_group())
        else:
            from torch.distributed.fsdp import fully_shard

            if wrapping == "fsdp_layers":  # torchtitan's wrapping: each block, then the root
                for block in model.model.layers.values():
                    fully_shard(block, mesh=mesh["dp"])
            fully_shard(model, mesh=mesh["dp"])
            compiled = step_model = burstc.compile(model, mesh, seq_dims=("cp",), backend="aot_eager")
    loss = zoo.call_with_loss(step_model, _replica_batch(replica))
    loss.backward()
    grads = {name: grad.full_tensor() if hasattr(grad, "full_tensor") else grad  # FSDP2: a DTensor over "dp"
             for name, grad in parameter_grads(model).items()}
    report = burstc.report(compiled)
    return {"errors": training_step_errors(loss.detach(), ref_loss, grads, ref_grads, SHARDED_GRAD_FLOOR),
            "summary": str(report),
            "codes": [s.code for s in report.skipped], "warnings": [str(w.message) for w in caught]}


@pytest.mark.parametrize("wrapping", ["ddp", "ddp_then_compile", "fsdp_root", "fsdp_layers"])
def test_sequence_rings_inside_data_parallel_replicas(workers, wrapping):
    from burstc.testing.oracle import errors_above

    rtol = tolerance(torch.float32, "sharded_param_grad").rtol
    for result in workers.get(DP * CP).run(_data_parallel_task, wrapping):
        assert not errors_above(result["errors"], rtol, rtol), result
        sharded = "sharded over 2 ranks" in result["summary"]
        notes = [w for w in result["warnings"] if "fully_shard was applied to submodules" in w]
        if wrapping == "fsdp_layers":
            assert not sharded and "pipeline.fsdp_submodules" in result["codes"] and notes, result
            assert "model.layers.0, model.layers.1" in notes[0]
            # the report's first lines give the cause beside each replicated graph's own refusal
            replicated = [line for line in result["summary"].splitlines() if "replicated on 2 ranks" in line]
            assert replicated and all("because fully_shard wraps submodules" in line for line in replicated), \
                result["summary"]
        else:
            assert sharded and not notes and "pipeline.fsdp_submodules" not in result["codes"], result
            assert "graph 1" not in result["summary"], result["summary"]  # one graph holds the whole step
