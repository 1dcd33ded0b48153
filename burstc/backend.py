"""The torch.compile backend: Dynamo graph -> "dynamo" passes -> :mod:`burstc.lowering` (AOTAutograd, the
AOT-stage passes, Inductor or aot_eager) -> the runtime guards of :mod:`burstc.guards`."""
from __future__ import annotations

import contextlib
import dataclasses
import functools
import sys

import torch
import torch.fx as fx

from burstc._logging import dump_graph
from burstc.config import BurstConfig
from burstc.errors import check_mesh_alive
from burstc.guards import all_ones_guarded, check_same_inputs_on_all_ranks, exactness_guarded, \
    note_exactness_fallback, note_padded_fallback, reinsert_dropped_outputs, warn_replicated_graph, \
    watch_recompile_limit
from burstc.lowering import lower
from burstc.pass_context import GraphFacts, PassContext
from burstc.passes import run_stage
from burstc.report import Report, snapshot_graph
from burstc.sharding.codes import CODES as SHARD_CODES


def _tracing_config(config: BurstConfig):
    """Dynamo settings while it traces a burstc model; they keep a checkpointed model in one graph, so that
    attention and loss meet in it and the sequence can be sharded through every layer."""
    ignored_logging = set(torch._dynamo.config.ignore_logging_functions)
    hf_logging = sys.modules.get("transformers.utils.logging")
    if hf_logging is not None and hasattr(hf_logging, "warning_once"):
        # HF's one-time warnings (e.g. "use_cache=True is incompatible with gradient checkpointing") break
        # the graph before the model body otherwise, leaving the loss in a graph of its own
        ignored_logging.add(hf_logging.warning_once)
    # optimize_ddp off: for a model wrapped in DDP, Dynamo's DDPOptimizer would cut the graph at every gradient
    # bucket (so each bucket's all-reduce overlaps the backward of the pieces before it), and the pieces after the
    # first have no token inputs and run replicated; one graph shards the whole sequence, and DDP's reducer still
    # averages the gradients (after the backward instead of overlapping it)
    return torch._dynamo.config.patch(
        skip_fwd_side_effects_in_bwd_under_checkpoint=not config.replay_checkpoint_side_effects,
        ignore_logging_functions=ignored_logging, optimize_ddp=False)


def _validate_device_lifted(query, key, value):
    """torch's FlexAttention device check without its "no backward on CPU" refusal (see below)."""
    if query.device.type != "cpu":
        _FLEX_VALIDATE_DEVICE[0](query, key, value)


_FLEX_VALIDATE_DEVICE = []  # torch's own check, saved the first time it is lifted


@contextlib.contextmanager
def _flex_backward_on_cpu():
    """torch refuses to trace FlexAttention on CPU when its inputs require grad (it has no CPU backward
    kernel); on a mesh burstc replaces every FlexAttention it recognizes by the ring op, which has one, so
    the check is lifted while Dynamo traces (and guards) a burstc model.  A FlexAttention burstc refuses runs
    torch's dense backward under aot_eager and fails as torch's would under Inductor.  One function object
    stands in for the check, so Dynamo's guard on it holds from call to call."""
    module = sys.modules.get("torch.nn.attention.flex_attention")
    if module is None or not hasattr(module, "_validate_device"):
        yield
        return
    original = module._validate_device
    if original is not _validate_device_lifted:
        _FLEX_VALIDATE_DEVICE[:] = [original]
    module._validate_device = _validate_device_lifted
    try:
        yield
    finally:
        module._validate_device = original


@contextlib.contextmanager
def _calling(config: BurstConfig, report: Report, mesh, world_size: int):
    """Around every call of a burstc model: its mesh must still be usable, Dynamo traces with
    :func:`_tracing_config` (and, on a mesh, FlexAttention's CPU backward check lifted), and a recompile
    limit hit during the call is reported."""
    if world_size > 1:
        check_mesh_alive(mesh)
    flex = _flex_backward_on_cpu() if world_size > 1 else contextlib.nullcontext()
    with _tracing_config(config), flex, watch_recompile_limit(report):
        yield


class BurstBackend:
    """``torch.compile(model, backend=BurstBackend(config, mesh, report))``.

    The burstc passes run on the Dynamo graph, before AOTAutograd and Inductor compute their cache
    keys, so a cache hit can never skip a rewrite.  The AOTAutograd cache is bypassed for burstc
    graphs so that the forward and backward graphs can be shown in the report; Inductor's FX-graph
    cache (the expensive codegen) still applies.
    """

    def __init__(self, config: BurstConfig, report: Report, mesh=None, world_size: int = 1,
                 ring_groups: tuple[str, ...] = ()):
        self.config = config
        self.report = report
        self.mesh = mesh  # 1-D: the sequence dims, flattened (burstc.api.SequenceMesh)
        self.ring_groups = ring_groups
        self.world_size = world_size
        # Dynamo enters this around every call of the compiled model (so around its tracing); an instance
        # attribute, as Dynamo's backend wrapper copies __dict__ and not class attributes
        self.backend_ctx_ctor = functools.partial(_calling, config, report, mesh, world_size)

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
        record.graphs["captured"] = snapshot_graph(gm)
        dump_graph("captured", record.graph_id, gm)
        gm, context = self._rewrite(gm, example_inputs, record, self.config)
        guarded = context.facts.all_ones_inputs
        if guarded and context.facts.sharding is None:
            # the all-ones specialization bought nothing (the shard pass refused for another reason):
            # redo the passes without it, so that no call pays for the check or a second compile, and
            # keep that other reason, the one that matters to the user
            refusals = [s for s in self.report.skipped if s.graph_id == record.graph_id and s.kind == "shard"]
            gm, context = self._rewrite(snapshot_graph(record.graphs["captured"]), example_inputs, record,
                                        self._without_specialization(), replace=True)
            for refusal in refusals:
                self.report.skipped.append(dataclasses.replace(
                    refusal, reason=f"even with the attention-mask input assumed all ones: {refusal.reason}"))
            guarded = ()
        compiled = self._finish(gm, example_inputs, record, context)
        self._warn_if_replicated(record, context)  # lowered: no RestartAnalysis will discard this attempt
        checks = context.facts.sharding.call_checks if context.facts.sharding is not None else ()
        if checks:
            fallback_ids = []  # the unsharded graph's id: the next graph's until it is compiled

            def note(code):
                fallback_ids[:] = fallback_ids or [len(self.report.graph_records)]
                note_exactness_fallback(self.report, record.graph_id, fallback_ids[0], code)

            compiled = exactness_guarded(compiled, checks, lambda args: self._compile_unsharded(record, args), note)
        if not guarded:
            return compiled
        return all_ones_guarded(compiled, guarded,
                                lambda args: self._compile_fallback(record, args, guarded))

    def _rewrite(self, gm, example_inputs, record, config, replace: bool = False):
        """The Dynamo-stage passes on ``gm`` -> (gm, context); ``replace`` drops what an earlier run on this
        graph recorded."""
        if replace:
            self.report.forget_graph(record.graph_id)
            record.graphs = {"captured": record.graphs["captured"]}
        context = PassContext(report=self.report, graph_id=record.graph_id, world_size=self.world_size,
                              mesh=self.mesh, ring_groups=self.ring_groups, example_inputs=list(example_inputs),
                              facts=GraphFacts())
        gm = run_stage("dynamo", gm, config=config, context=context, graphs=record.graphs)
        record.graphs["rewritten"] = snapshot_graph(gm)
        dump_graph("rewritten", record.graph_id, gm)
        record.dropped_outputs = context.facts.dropped_outputs
        record.sharding = context.facts.sharding
        return gm, context

    def _warn_if_replicated(self, record, context) -> None:
        """Once per graph, after its last planning: attention the shard pass refused to shard (not a graph
        without sequence work, nor a user's disable_passes=("shard",))."""
        if self.world_size <= 1 or context.facts.sharding is not None or not context.facts.attention:
            return
        refusals = [s for s in self.report.skipped if s.graph_id == record.graph_id and s.kind == "shard"]
        if refusals and refusals[0].code != SHARD_CODES.no_sequence_work:
            warn_replicated_graph(self.report, refusals[0], self.world_size, len(context.facts.attention))

    def _without_specialization(self) -> BurstConfig:
        return dataclasses.replace(self.config, disable_passes=self.config.disable_passes + ("assume_unpadded",))

    def _compile_fallback(self, record, args, guarded):
        """The graph without the all-ones assumption (so unsharded), compiled on the first call whose
        guarded inputs are not all ones."""
        placeholders = [n for n in record.graphs["captured"].graph.nodes if n.op == "placeholder"]
        names = ", ".join(f"`{placeholders[i].name}`" for i in guarded)
        note_padded_fallback(self.report, record.graph_id, names)
        return self._compile_again(record, args, self._without_specialization())

    def _compile_unsharded(self, record, args):
        """The graph with no shard pass (replicated, the model's attention as written), compiled on the first
        call a sharded graph can't compute exactly (see ``exactness_guarded``)."""
        return self._compile_again(record, args, dataclasses.replace(
            self.config, disable_passes=self.config.disable_passes + ("shard",)))

    def _compile_again(self, record, args, config):
        """``record``'s captured graph through the passes under ``config`` and lowered; its own graph record."""
        fallback_record = self.report.new_graph()
        fallback_record.graphs["captured"] = record.graphs["captured"]
        gm, context = self._rewrite(snapshot_graph(record.graphs["captured"]), args, fallback_record, config)
        return self._finish(gm, args, fallback_record, context)

    def _finish(self, gm, example_inputs, record, context):
        """Lower ``gm``; wrap it to check the inputs and put back the outputs the passes dropped."""
        compiled = lower(gm, example_inputs, config=self.config, context=context, record=record)
        dropped = record.dropped_outputs
        check_positions = self._token_input_positions(gm) if self._checks_inputs(record) else []
        # the ring's host copies of mask data (burstc.ops.host_reads) live for one forward and its backward
        sharded = self.world_size > 1 and record.sharding is not None
        from burstc.ops import host_reads
        if not dropped and not check_positions and not sharded:
            return compiled

        # Dynamo calls a backend's result with the graph inputs unpacked (*args), whatever
        # ``_boxed_call`` says; so does this wrapper (no functools.wraps: it would copy that flag)
        def run(*args):
            if sharded:
                host_reads.new_step()
            if check_positions:
                check_same_inputs_on_all_ranks([args[i] for i in check_positions], self.mesh, self.config.timeout)
            outputs = compiled(*args)
            return reinsert_dropped_outputs(outputs, dropped) if dropped else outputs

        return run

    def _checks_inputs(self, record) -> bool:
        # an unsharded (replicated) graph computes each rank's own batch correctly: nothing to check
        return self.config.check_inputs and self.world_size > 1 and record.sharding is not None

    @staticmethod
    def _token_input_positions(gm) -> list[int]:
        from burstc.passes.graph_utils import placeholder_kind, val

        placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
        return [i for i, n in enumerate(placeholders) if placeholder_kind(n) == "input"
                and isinstance(val(n), torch.Tensor) and not val(n).is_floating_point()]
