"""The one lowering path after the Dynamo-stage passes:

    AOTAutograd (joint graph -> burstc's partitioner hook) -> "aot_forward" / "aot_backward" passes
    -> Inductor's ``compile_fx_inner`` or aot_eager (the graph run as is)

Both backends go through the same hook points, so an AOT-stage pass (the coming ``schedule`` and
``checkpoint`` passes) is a plain registry entry in ``burstc.passes.PASSES``.  The partitioner hook is
:func:`partitioner_class`'s ``BurstPartitioner``: today it runs torch's min-cut rematerialization partitioner unchanged (what
both backends used before); recompute decisions of a ``checkpoint`` pass plug in there.

The AOTAutograd cache is bypassed for burstc graphs so that the forward and backward graphs are
recorded in the report and the AOT passes always run; Inductor's FX-graph cache (the expensive codegen)
still applies, keyed on the partitioner's ``uuid()`` among the rest.
"""
from __future__ import annotations

import torch
import torch.fx as fx

from burstc._logging import dump_graph, log_event
from burstc.report import snapshot_graph


def partitioner_class() -> type:
    """:class:`burstc.partitioner.BurstPartitioner`, imported on first use: importing Inductor (and with it
    Triton) is deferred to the first compile, as torch.compile itself does."""
    from burstc.partitioner import BurstPartitioner

    return BurstPartitioner


def _stage_runner(stage: str, *, config, context, record):
    """Records the AOT graph of ``stage`` ("forward"/"backward"), then runs that stage's passes on it."""
    from burstc.passes import run_stage

    def run(stage_gm: fx.GraphModule) -> fx.GraphModule:
        record.graphs[stage] = snapshot_graph(stage_gm)
        dump_graph(stage, record.graph_id, stage_gm)
        log_event("passes", "graph %d: lowered %s graph (%d nodes)", record.graph_id, stage, len(stage_gm.graph.nodes))
        return run_stage(f"aot_{stage}", stage_gm, config=config, context=context, graphs=record.graphs)

    return run


def lower(gm: fx.GraphModule, example_inputs, *, config, context, record):
    """Compile the rewritten Dynamo graph ``gm`` with ``config.backend``; returns the callable Dynamo runs."""
    run_forward = _stage_runner("forward", config=config, context=context, record=record)
    run_backward = _stage_runner("backward", config=config, context=context, record=record)
    partitioner = partitioner_class()()
    if config.memory_budget is not None and context.facts.sharding is None:
        context.report.notes.append(f"graph {record.graph_id}: memory_budget not planned: the graph is not sharded "
                                    "(burstc's checkpoint modes apply to sharded graphs only)")
    elif config.memory_budget is not None:
        from burstc.memory import overlap_option, resident_bytes

        parameters, buffers = resident_bytes(record.graphs.get("captured"))
        # overlap: how the overlap_ring_backward pass will reorder the backward (the replay follows it)
        partitioner.budget = dict(report=context.report, budget=config.memory_budget, backend=config.backend,
                                  world_size=context.world_size, parameters=parameters, buffers=buffers,
                                  graph_id=record.graph_id, overlap=overlap_option(config))
    if config.checkpoint_keep < 1 and context.facts.sharding is None:
        context.report.notes.append(f"graph {record.graph_id}: checkpoint_keep not applied: the graph is not sharded "
                                    "(on one device the attention's whole output is kept)")
    elif config.checkpoint_keep < 1:
        partitioner.keep = dict(fraction=config.checkpoint_keep, report=context.report,
                                world_size=context.world_size, graph_id=record.graph_id)
    if config.backend == "aot_eager":
        from functorch.compile import make_boxed_func
        from torch._dynamo.backends.common import aot_autograd

        def eager_stage(run_passes):
            def compile_stage(stage_gm, stage_inputs):
                return make_boxed_func(run_passes(stage_gm).forward)
            return compile_stage

        aot = aot_autograd(fw_compiler=eager_stage(run_forward), bw_compiler=eager_stage(run_backward),
                           partition_fn=partitioner)
        with torch._functorch.config.patch(enable_autograd_cache=False):
            return aot(gm, example_inputs)

    from torch._inductor.compile_fx import compile_fx, compile_fx_inner

    def inner_compile(stage_gm, stage_inputs, *args, **kwargs):
        from burstc.memory import inductor_schedule

        stage = "backward" if kwargs.get("is_backward") else "forward"
        run_passes = run_backward if stage == "backward" else run_forward
        with inductor_schedule() as schedule:  # the memory model replays the graph in this order
            compiled = compile_fx_inner(run_passes(stage_gm), stage_inputs, *args, **kwargs)
        record.schedules[stage] = schedule
        return compiled

    with torch._functorch.config.patch(enable_autograd_cache=False):
        return compile_fx(gm, example_inputs, inner_compile=inner_compile,
                          config_patches={"custom_partitioner_fn": partitioner})
