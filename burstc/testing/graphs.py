"""Dynamo graphs for pass tests: capture the torch-level graph a pass would see, optionally running a
callback inside the backend call (where Dynamo still holds the values of buffers and inputs; it drops
them once the backend returns)."""
from __future__ import annotations

from typing import Any, Callable

import torch
import torch.fx as fx


class _Captured(Exception):
    """Raised by the capturing backend when the graph must not run (``run=False``)."""


def dynamo_graph(fn, *inputs, inside: Callable[[fx.GraphModule, list], Any] | None = None,
                 fullgraph: bool = True, run: bool = True) -> fx.GraphModule | tuple[fx.GraphModule, Any]:
    """The one Dynamo graph of ``fn(*inputs)``; with ``inside``, ``(graph, inside(graph, example_inputs))``
    evaluated within the backend call.  ``run=False`` stops after the capture: nothing is computed at the
    inputs' size (Dynamo traces with fake tensors), so long sequences cost no memory."""
    found = []

    def backend(gm, example_inputs):
        found.append((gm, inside(gm, list(example_inputs)) if inside is not None else None))
        if not run:
            raise _Captured
        return gm.forward

    torch._dynamo.reset()
    try:
        torch.compile(fn, backend=backend, fullgraph=fullgraph)(*inputs)
    except torch._dynamo.exc.BackendCompilerFailed as failed:
        if not isinstance(failed.inner_exception, _Captured):
            raise
    if len(found) != 1:
        raise AssertionError(f"expected one Dynamo graph, got {len(found)}")
    gm, result = found[0]
    return (gm, result) if inside is not None else gm


def detect_attention_in(fn, *inputs, world_size: int = 2, run: bool = True):
    """The ``detect_attention`` pass on ``fn``'s Dynamo graph, run inside the backend (where Dynamo still holds
    the values of buffers) -> (graph after the pass, its PassContext, the rewritten graph's output on
    ``inputs`` — None with ``run=False``)."""
    from burstc.config import BurstConfig
    from burstc.pass_context import PassContext
    from burstc.passes.detect_attention import detect_attention
    from burstc.report import Report

    def run_pass(gm, example_inputs):
        context = PassContext(report=Report(BurstConfig(), world_size=world_size), graph_id=0,
                              world_size=world_size, example_inputs=example_inputs)
        context.start_pass("detect_attention")
        detect_attention(gm, config=BurstConfig(), context=context)
        if not run:
            return context, None
        gm.graph.lint()
        gm.recompile()
        output = gm(*example_inputs)
        return context, output[0] if isinstance(output, (tuple, list)) else output

    gm, (context, output) = dynamo_graph(fn, *inputs, inside=run_pass, run=run)
    return gm, context, output
