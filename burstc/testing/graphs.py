"""Dynamo graphs for pass tests: capture the torch-level graph a pass would see, optionally running a
callback inside the backend call (where Dynamo still holds the values of buffers and inputs; it drops
them once the backend returns)."""
from __future__ import annotations

from typing import Any, Callable

import torch
import torch.fx as fx


def dynamo_graph(fn, *inputs, inside: Callable[[fx.GraphModule, list], Any] | None = None,
                 fullgraph: bool = True) -> fx.GraphModule | tuple[fx.GraphModule, Any]:
    """The one Dynamo graph of ``fn(*inputs)``; with ``inside``, ``(graph, inside(graph, example_inputs))``
    evaluated within the backend call."""
    found = []

    def backend(gm, example_inputs):
        found.append((gm, inside(gm, list(example_inputs)) if inside is not None else None))
        return gm.forward

    torch._dynamo.reset()
    torch.compile(fn, backend=backend, fullgraph=fullgraph)(*inputs)
    if len(found) != 1:
        raise AssertionError(f"expected one Dynamo graph, got {len(found)}")
    gm, result = found[0]
    return (gm, result) if inside is not None else gm
