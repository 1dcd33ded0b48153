"""burstc's partitioner hook (AOTAutograd's joint graph -> forward and backward graphs), a module of its own so
that Inductor can pickle it with its config (its FX-graph cache); imported on the first compile
(:func:`burstc.lowering.partitioner_class`), since importing Inductor pulls in Triton."""
from __future__ import annotations

from typing import Any, Sequence

import torch.fx as fx
from torch._inductor.custom_graph_pass import CustomPartitionerFn, get_hash_for_files

import burstc.lowering


class BurstPartitioner(CustomPartitionerFn):
    """Splits AOTAutograd's joint graph into forward and backward graphs (torch's min-cut partitioner).
    With ``memory_budget=`` (``budget``: the graph's facts), the checkpoint mode that fits is chosen here
    (:func:`burstc.memory.partition_within_budget`)."""

    budget: dict | None = None
    keep: dict | None = None  # checkpoint_keep < 1: fraction, report, world_size, graph_id

    def __call__(self, joint_gm: fx.GraphModule, joint_inputs: Sequence[object], **kwargs: Any
                 ) -> tuple[fx.GraphModule, fx.GraphModule]:
        from functorch.compile import min_cut_rematerialization_partition

        if self.keep is not None:
            from burstc.kept_rows import keep_attention_rows, retag_for_recompute

            retag_for_recompute(joint_gm)  # partitioned as "layers", then each recompute narrowed to its rows
            fw, bw = min_cut_rematerialization_partition(joint_gm, joint_inputs, **kwargs)
            kept = keep_attention_rows(fw, bw, self.keep["fraction"], kwargs["num_fwd_outputs"],
                                       self.keep["world_size"])
            self.keep["report"].set_kept_rows(self.keep["graph_id"], kept)
            return fw, bw
        if self.budget is None:
            return min_cut_rematerialization_partition(joint_gm, joint_inputs, **kwargs)
        from burstc.memory import partition_within_budget

        facts = dict(self.budget)
        report = facts.pop("report")
        graphs, plan = partition_within_budget(min_cut_rematerialization_partition, joint_gm, joint_inputs,
                                               kwargs, **facts)
        report.add_memory_plan(plan)
        report.set_kept_rows(plan.graph_id, list(plan.kept))
        return graphs

    def uuid(self) -> Any:
        budget = {k: v for k, v in (self.budget or {}).items() if k != "report"}
        keep = {k: v for k, v in (self.keep or {}).items() if k != "report"}
        return get_hash_for_files((__file__, burstc.lowering.__file__),
                                  extra=repr((sorted(budget.items()), sorted(keep.items()))))

    def __reduce__(self):
        # Inductor pickles its config (this instance among it) for its FX-graph cache: the class by reference,
        # no state (the budget holds the report, which is not picklable; the uuid carries the budget's numbers)
        return (BurstPartitioner, ())
