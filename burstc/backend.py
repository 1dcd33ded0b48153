"""The torch.compile backend: Dynamo graph -> burstc passes -> AOTAutograd + Inductor (or aot_eager)."""
from __future__ import annotations

import dataclasses
import functools
import sys
import warnings

import torch
import torch.fx as fx

from burstc._logging import dump_graph, log_event
from burstc.checkpoint_regions import inline_checkpoint_regions, outline_checkpoint_regions
from burstc.config import BurstConfig
from burstc.passes import PassContext, apply_passes
from burstc.passes.assume_unpadded import GUARD_META
from burstc.report import Report, SkipRecord


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


def check_same_inputs_on_all_ranks(tensors, mesh):
    """``check_inputs``: all-reduces (max of the hash and of its negation) of a cheap position-weighted hash of
    the token inputs; ranks given different batches get a clear error instead of a silently wrong loss.
    The digest lives on the inputs' device (NCCL reduces only GPU tensors)."""
    import torch.distributed as dist

    device = tensors[0].device if tensors else torch.device("cpu")
    digest = torch.zeros(2, dtype=torch.float64, device=device)
    for t in tensors:
        flat = t.detach().reshape(-1).to(torch.float64)
        weights = torch.arange(1, flat.numel() + 1, dtype=torch.float64, device=flat.device) % 7919 + 1
        digest[0] += (flat * weights).sum()
        digest[1] += flat.numel()
    group = mesh.get_group()
    high, low = digest.clone(), -digest
    dist.all_reduce(high, op=dist.ReduceOp.MAX, group=group)
    dist.all_reduce(low, op=dist.ReduceOp.MAX, group=group)
    if not torch.equal(high, -low):
        raise RuntimeError(
            "burstc: the ranks were given different batches: every rank must get the full, identical batch "
            "(no DistributedSampler over the sequence-parallel ranks); burstc shards the sequence itself. "
            "check_inputs=False turns this check off")


def _tracing_config(config: BurstConfig):
    """Dynamo settings while it traces a burstc model; they keep a checkpointed model in one graph, so that
    attention and loss meet in it and the sequence can be sharded through every layer."""
    ignored_logging = set(torch._dynamo.config.ignore_logging_functions)
    hf_logging = sys.modules.get("transformers.utils.logging")
    if hf_logging is not None and hasattr(hf_logging, "warning_once"):
        # HF's one-time warnings (e.g. "use_cache=True is incompatible with gradient checkpointing") break
        # the graph before the model body otherwise, leaving the loss in a graph of its own
        ignored_logging.add(hf_logging.warning_once)
    return torch._dynamo.config.patch(
        skip_fwd_side_effects_in_bwd_under_checkpoint=not config.replay_checkpoint_side_effects,
        ignore_logging_functions=ignored_logging)


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
        # Dynamo enters this around every call of the compiled model (so around its tracing); an instance
        # attribute, as Dynamo's backend wrapper copies __dict__ and not class attributes
        self.backend_ctx_ctor = functools.partial(_tracing_config, config)

    def __call__(self, gm: fx.GraphModule, example_inputs):
        record = self.report.new_graph()
        try:
            return self._compile_graph(gm, example_inputs, record)
        except torch._dynamo.exc.RestartAnalysis:
            # Dynamo retraces the frame (e.g. a Python float it had made symbolic is specialized after all) and
            # calls the backend again: this attempt's graph never runs, so it leaves no trace in the report
            self.report.discard_graph(record.graph_id)
            raise

    def _compile_graph(self, gm: fx.GraphModule, example_inputs, record):
        record.graphs["captured"] = snapshot(gm)
        dump_graph("captured", record.graph_id, gm)
        gm = self._rewrite(gm, example_inputs, record, self.config)
        guarded = tuple(gm.meta.get(GUARD_META, ()))
        if guarded and not self._sharded(record.graph_id):
            # the all-ones specialization bought nothing (the shard pass refused for another reason):
            # redo the passes without it, so that no call pays for the check or a second compile, and
            # keep that other reason, the one that matters to the user
            refusals = [s for s in self.report.skipped if s.graph_id == record.graph_id and s.kind == "shard"]
            gm = self._rewrite(snapshot(record.graphs["captured"]), example_inputs, record,
                               self._without_specialization(), replace=True)
            for refusal in refusals:
                self.report.skipped.append(dataclasses.replace(
                    refusal, reason=f"even with the attention-mask input assumed all ones: {refusal.reason}"))
            guarded = ()
        compiled = self._finish(gm, example_inputs, record)
        if not guarded:
            return compiled
        fallback = []

        def run(*args):
            if all(bool(args[i].all()) for i in guarded):
                return compiled(*args)
            if not fallback:
                fallback.append(self._compile_fallback(record, args, guarded))
            return fallback[0](*args)

        return run

    def _rewrite(self, gm, example_inputs, record, config, replace: bool = False):
        """The passes on ``gm``; ``replace`` drops what an earlier run on this graph recorded."""
        if replace:
            self.report.forget_graph(record.graph_id)
        context = PassContext(report=self.report, graph_id=record.graph_id, world_size=self.world_size,
                              mesh=self.mesh, example_inputs=list(example_inputs))
        # on a mesh the passes must see inside checkpointed layers (sharding flows through them)
        regions = inline_checkpoint_regions(gm) if self.world_size > 1 else []
        gm = apply_passes(gm, config=config, context=context)
        if regions:
            restored, kept = outline_checkpoint_regions(gm, regions)
            for line in restored:
                context.rewrite("checkpoint_region", "graph", {"restored": line}, module="")
            for line in kept:
                context.skip("checkpoint_region", "graph", line, module="")
        record.graphs["rewritten"] = snapshot(gm)
        dump_graph("rewritten", record.graph_id, gm)
        record.dropped_outputs = tuple(gm.meta.get("burstc_dropped_outputs", ()))
        return gm

    def _sharded(self, graph_id: int) -> bool:
        return any(r.kind == "shard" and r.graph_id == graph_id for r in self.report.rewrites)

    def _without_specialization(self) -> BurstConfig:
        return dataclasses.replace(self.config, disable_passes=self.config.disable_passes + ("assume_unpadded",))

    def _compile_fallback(self, record, args, guarded):
        """The graph without the all-ones assumption (so unsharded), compiled on the first call whose
        guarded inputs are not all ones; it gets its own graph record in the report."""
        placeholders = [n for n in record.graphs["captured"].graph.nodes if n.op == "placeholder"]
        names = ", ".join(f"`{placeholders[i].name}`" for i in guarded)
        message = (f"input {names} was not all ones (a padded batch): the calls with such inputs run graph "
                   f"{len(self.report.graph_records)}, compiled without the assumption (unsharded, replicated)")
        self.report.skipped.append(SkipRecord("unpadded_mask", names, "", message, record.graph_id, "backend"))
        log_event("rewrites", "graph %d: %s", record.graph_id, message)
        warnings.warn(f"burstc: {message}", stacklevel=2)
        fallback_record = self.report.new_graph()
        fallback_record.graphs["captured"] = record.graphs["captured"]
        gm = self._rewrite(snapshot(record.graphs["captured"]), args, fallback_record,
                           self._without_specialization())
        return self._finish(gm, args, fallback_record)

    def _finish(self, gm, example_inputs, record):
        """Lower ``gm``; wrap it to check the inputs and put back the outputs the passes dropped."""
        compiled = self._lower(gm, example_inputs, record)
        dropped = record.dropped_outputs
        check_positions = self._token_input_positions(gm) if self._checks_inputs(record) else []
        if not dropped and not check_positions:
            return compiled

        # Dynamo calls a backend's result with the graph inputs unpacked (*args), whatever
        # ``_boxed_call`` says; so does this wrapper (no functools.wraps: it would copy that flag)
        def run(*args):
            if check_positions:
                check_same_inputs_on_all_ranks([args[i] for i in check_positions], self.mesh)
            outputs = compiled(*args)
            return _reinsert_dropped(outputs, dropped) if dropped else outputs

        return run

    def _checks_inputs(self, record) -> bool:
        # an unsharded (replicated) graph computes each rank's own batch correctly: nothing to check
        return self.config.check_inputs and self.world_size > 1 and self._sharded(record.graph_id)

    @staticmethod
    def _token_input_positions(gm) -> list[int]:
        from burstc.passes.graph_utils import placeholder_kind, val

        placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
        return [i for i, n in enumerate(placeholders) if placeholder_kind(n) == "input"
                and isinstance(val(n), torch.Tensor) and not val(n).is_floating_point()]

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
