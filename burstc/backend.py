"""The torch.compile backend: Dynamo graph -> burstc passes -> AOTAutograd + Inductor (or aot_eager)."""
from __future__ import annotations

import functools

import torch
import torch.fx as fx

from burstc._logging import dump_graph, log_event
from burstc.config import BurstConfig
from burstc.passes import PassContext, apply_passes
from burstc.report import Report


def snapshot(gm: fx.GraphModule) -> fx.GraphModule:
    """A copy of ``gm``'s graph (node meta shared, not deep-copied) that later passes can't mutate."""
    graph = fx.Graph()
    out = graph.graph_copy(gm.graph, {})
    graph.output(out)
    copy = fx.GraphModule(gm, graph)
    copy.meta = dict(getattr(gm, "meta", {}))
    return copy


def _reinsert_dropped(outputs, dropped: tuple[int, ...]):
    values = list(outputs)
    for index in sorted(dropped):
        values.insert(index, None)
    return type(outputs)(values) if isinstance(outputs, tuple) else values


class BurstBackend:
    """``torch.compile(model, backend=BurstBackend(config, mesh, report))``.

    The burstc passes run on the Dynamo graph, before AOTAutograd and Inductor compute their cache
    keys, so a cache hit can never skip a rewrite.  The AOTAutograd cache is bypassed for burstc
    graphs so that the forward and backward graphs can be shown in the report; Inductor's FX-graph
    cache (the expensive codegen) still applies.
    """

    def __init__(self, config: BurstConfig, report: Report, mesh=None, world_size: int = 1):
        self.config = config
        self.report = report
        self.mesh = mesh
        self.world_size = world_size

    def __call__(self, gm: fx.GraphModule, example_inputs):
        record = self.report.new_graph()
        record.graphs["captured"] = snapshot(gm)
        dump_graph("captured", record.graph_id, gm)
        context = PassContext(report=self.report, graph_id=record.graph_id, world_size=self.world_size,
                              mesh=self.mesh, example_inputs=list(example_inputs))
        gm = apply_passes(gm, config=self.config, context=context)
        record.graphs["rewritten"] = snapshot(gm)
        dump_graph("rewritten", record.graph_id, gm)
        record.dropped_outputs = tuple(gm.meta.get("burstc_dropped_outputs", ()))

        compiled = self._lower(gm, example_inputs, record)
        if not record.dropped_outputs:
            return compiled
        dropped = record.dropped_outputs

        @functools.wraps(compiled)
        def run_with_dropped_outputs(*args):
            return _reinsert_dropped(compiled(*args), dropped)

        if getattr(compiled, "_boxed_call", False):
            run_with_dropped_outputs._boxed_call = True
        return run_with_dropped_outputs

    def _record_stage(self, record, stage: str, gm: fx.GraphModule):
        record.graphs[stage] = snapshot(gm)
        dump_graph(stage, record.graph_id, gm)
        log_event("passes", "graph %d: lowered %s graph (%d nodes)", record.graph_id, stage, len(gm.graph.nodes))

    def _lower(self, gm, example_inputs, record):
        if self.config.backend == "aot_eager":
            from functorch.compile import make_boxed_func, min_cut_rematerialization_partition
            from torch._dynamo.backends.common import aot_autograd

            def stage_compiler(stage):
                def compile_stage(stage_gm, stage_inputs):
                    self._record_stage(record, stage, stage_gm)
                    return make_boxed_func(stage_gm.forward)
                return compile_stage

            lower = aot_autograd(fw_compiler=stage_compiler("forward"), bw_compiler=stage_compiler("backward"),
                                 partition_fn=min_cut_rematerialization_partition)
            with torch._functorch.config.patch(enable_autograd_cache=False):
                return lower(gm, example_inputs)

        from torch._inductor.compile_fx import compile_fx, compile_fx_inner

        def recording_inner_compile(stage_gm, stage_inputs, *args, **kwargs):
            self._record_stage(record, "backward" if kwargs.get("is_backward") else "forward", stage_gm)
            return compile_fx_inner(stage_gm, stage_inputs, *args, **kwargs)

        with torch._functorch.config.patch(enable_autograd_cache=False):
            return compile_fx(gm, example_inputs, inner_compile=recording_inner_compile)
