"""Small helpers shared by the passes: example values, placeholder kinds, constant folding."""
from __future__ import annotations

import math
import operator

import torch
import torch.fx as fx


def val(node):
    """The FakeTensor (or other example value) Dynamo recorded for ``node``."""
    if not isinstance(node, fx.Node):
        return None
    return node.meta.get("example_value", node.meta.get("val"))


def fake_mode_of(gm: fx.GraphModule):
    from torch._subclasses.fake_tensor import FakeTensor

    for node in gm.graph.nodes:
        v = val(node)
        if isinstance(v, FakeTensor):
            return v.fake_mode
    return None


def set_meta(node: fx.Node, fn, args, kwargs, fake_mode):
    """Run ``fn`` on the inputs' fake values so that ``node`` gets a consistent ``example_value``."""
    if fake_mode is None:
        return
    fargs = fx.node.map_aggregate(args, lambda a: val(a) if isinstance(a, fx.Node) else a)
    fkwargs = fx.node.map_aggregate(kwargs, lambda a: val(a) if isinstance(a, fx.Node) else a)
    with fake_mode:
        node.meta["example_value"] = fn(*fargs, **fkwargs)


def is_function(node, *targets) -> bool:
    return isinstance(node, fx.Node) and node.op == "call_function" and node.target in targets


def is_method(node, *names) -> bool:
    return isinstance(node, fx.Node) and node.op == "call_method" and node.target in names


def op_name(node: fx.Node) -> str:
    if node.op == "call_method":
        return f".{node.target}"
    return getattr(node.target, "__name__", str(node.target))


def placeholder_kind(node: fx.Node) -> str:
    """``"parameter"``, ``"buffer"`` (module state) or ``"input"`` (a value the caller passes)."""
    grapharg = node.meta.get("grapharg")
    example = getattr(grapharg, "example", None) if grapharg is not None else None
    if isinstance(example, torch.nn.Parameter):
        return "parameter"
    source = getattr(grapharg, "source", None)
    name = getattr(source, "name", "") if source is not None else ""
    name = name() if callable(name) else str(name)
    if "_buffers" in name or "buffers" in node.name:
        return "buffer"
    return "input"


def placeholder_example(node: fx.Node):
    grapharg = node.meta.get("grapharg")
    return getattr(grapharg, "example", None) if grapharg is not None else None


def ancestors(node: fx.Node) -> list[fx.Node]:
    seen, stack, order = set(), [node], []
    while stack:
        n = stack.pop()
        if n in seen:
            continue
        seen.add(n)
        order.append(n)
        stack.extend(n.all_input_nodes)
    return order


class NotConstant(Exception):
    pass


def evaluate_constant(gm: fx.GraphModule, node: fx.Node, max_numel: int = 2**28):
    """Evaluate ``node`` with real tensors if it depends only on constants and module buffers
    (never on the caller's inputs or on parameters); raises :class:`NotConstant` otherwise.

    Buffers are read at compile time: a mask kept in a buffer (nanoGPT's ``tril``) is assumed not
    to change between calls."""
    order = [n for n in gm.graph.nodes if n in set(ancestors(node))]
    env = {}
    for n in order:
        if n.op == "placeholder":
            if placeholder_kind(n) != "buffer":
                raise NotConstant(f"depends on the {placeholder_kind(n)} `{n.name}`")
            env[n] = placeholder_example(n)
            if env[n] is None:
                raise NotConstant(f"no value recorded for buffer `{n.name}`")
            continue
        v = val(n)
        if isinstance(v, torch.Tensor) and v.numel() > max_numel:
            raise NotConstant(f"`{n.name}` has {v.numel():,} elements, too many to evaluate at compile time")
        args = fx.node.map_arg(n.args, lambda a: env[a])
        kwargs = fx.node.map_arg(n.kwargs, lambda a: env[a])
        if n.op == "call_function":
            env[n] = n.target(*args, **kwargs)
        elif n.op == "call_method":
            env[n] = getattr(args[0], n.target)(*args[1:], **kwargs)
        elif n.op == "get_attr":
            env[n] = getattr(gm, n.target)
        else:
            raise NotConstant(f"cannot evaluate `{n.op}` node `{n.name}`")
    return env[node]


def const_number(x):
    return x if isinstance(x, (int, float)) and not isinstance(x, bool) else None


def prod(xs) -> int:
    return math.prod(int(x) for x in xs)


__all__ = ["val", "fake_mode_of", "set_meta", "is_function", "is_method", "op_name", "placeholder_kind",
           "placeholder_example", "ancestors", "evaluate_constant", "NotConstant", "const_number", "prod",
           "operator"]
