"""Pass ``share_replicated_grads`` (stage dynamo, mesh only, ``reduce_grads=False``): a graph that runs replicated
gives each rank a share of its parameter gradients, so that summing over the ranks gives them once.

With ``reduce_grads=False`` the caller reduces parameter gradients over the sequence ranks itself (FSDP or DDP over
them, or an all-reduce): burstc leaves each rank's gradient local.  A sharded graph's local gradient is this rank's
tokens' part of the whole (the ranks' parts sum to it).  A graph that runs replicated (the shard pass refused it,
or a call one of its runtime checks sends to the unsharded graph: padding the specialization did not assume, a
row that sees no key) computes the whole gradient on every rank, so the same sum would count it P times: which
of the two a step got depends on burstc's choice and, for the fallbacks, on the batch.  This pass makes them one
contract: every parameter of a replicated graph passes through ``burstc.ops.sequence.grad_share`` (identity
forward, gradient divided by P), and the ranks' gradients always sum to the single-device gradient.

Numerics: ``g / P`` summed over P ranks is ``g`` exactly when P is a power of two, else within one rounding.
With ``reduce_grads=True`` (the default) nothing is needed: a replicated graph's gradients are already equal on
every rank, and a sharded graph's are summed in the graph.
"""
from __future__ import annotations

import torch.fx as fx

from burstc.ops.sequence import grad_share
from burstc.passes.graph_utils import fake_mode_of, wrap_trained_parameters

KIND = "share_replicated_grads"


def share_replicated_grads(gm: fx.GraphModule, *, config, context) -> fx.GraphModule:
    if config.reduce_grads:
        context.note = "reduce_grads=True: gradients are reduced in the graph (nothing to share)"
        return gm
    if context.facts.sharding is not None:
        context.note = "the graph is sharded: each rank's gradients are its tokens' part already"
        return gm
    shared = wrap_trained_parameters(gm.graph, grad_share, context.world_size, fake_mode=fake_mode_of(gm))
    if shared:
        context.rewrite(KIND, f"{shared} parameters", {
            "world_size": context.world_size,
            "why": "the graph runs replicated with reduce_grads=False: each rank keeps 1/P of every parameter "
                   "gradient, so the ranks' gradients sum to the single-device gradient, as a sharded graph's do"})
    else:
        context.note = "the graph runs replicated but has no parameter that needs a gradient"
    gm.recompile()
    return gm
