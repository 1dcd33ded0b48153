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


def shape_args(graph: fx.Graph, node: fx.Node, dims, fake_mode) -> tuple:
    """Sizes of ``node``'s dims ``dims`` as reshape arguments: ints where static; where symbolic (dynamic shapes),
    a ``node.size(d)`` node, since a raw SymInt is not a valid FX argument. Insert at the graph's insert point."""
    shape = val(node).shape
    sizes = []
    for dim in dims:
        size = shape[dim]
        if isinstance(size, int):
            sizes.append(size)
            continue
        size_node = graph.call_method("size", (node, dim))
        set_meta(size_node, lambda tensor, d: tensor.size(d), (node, dim), {}, fake_mode)
        sizes.append(size_node)
    return tuple(sizes)


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


_INPLACE_OPERATORS = {operator.setitem, operator.delitem, operator.iadd, operator.isub, operator.imul,
                      operator.itruediv, operator.ifloordiv, operator.imod, operator.ipow, operator.iand,
                      operator.ior, operator.ixor, operator.ilshift, operator.irshift, operator.imatmul}
# ops whose output may share storage with their first input: a mutation of one is a mutation of the other
_VIEW_METHODS = {"view", "view_as", "reshape", "reshape_as", "transpose", "permute", "t", "expand", "expand_as",
                 "unsqueeze", "squeeze", "narrow", "select", "unflatten", "flatten", "as_strided", "split", "chunk",
                 "unbind", "contiguous", "to", "type_as", "float", "detach", "__getitem__", "diagonal", "movedim",
                 "swapaxes", "unfold", "view_as_real", "view_as_complex", "real", "imag", "T", "mT"}
_VIEW_FUNCTIONS = {operator.getitem, torch.reshape, torch.transpose, torch.permute, torch.unsqueeze, torch.squeeze,
                   torch.narrow, torch.select, torch.flatten, torch.split, torch.chunk, torch.unbind, torch.t,
                   torch.movedim, torch.swapaxes, torch.diagonal, torch.view_as_real, torch.view_as_complex,
                   torch.detach}


def is_mutating(node: fx.Node) -> bool:
    """True for an op that writes into one of its inputs: ``x.scatter_(...)``, ``x[i] = v``, ``x += y``,
    ``torch.relu_(x)``, a mutable custom op, an ``out=`` call.  Dynamo graphs record such ops with
    their result unused (later readers name the mutated input), so nothing but this test keeps a
    pass from dropping them or reading the input's value from before the write."""
    if node.op == "call_method":
        name = node.target
        return name == "__setitem__" or (name.endswith("_") and not name.endswith("__"))
    if node.op != "call_function":
        return False
    if node.target in _INPLACE_OPERATORS or "out" in node.kwargs:
        return True
    schema = getattr(node.target, "_schema", None)
    if schema is not None and schema.is_mutable:
        return True
    name = getattr(node.target, "__name__", "")
    return name.endswith("_") and not name.endswith("__") and not name.startswith("_")


def _may_alias(node: fx.Node) -> fx.Node | None:
    """The input whose storage ``node``'s output may share (a view-like op), else None."""
    if node.op == "call_method" and node.target in _VIEW_METHODS and node.args:
        base = node.args[0]
    elif node.op == "call_function" and node.target in _VIEW_FUNCTIONS and node.args:
        base = node.args[0]
    else:
        return None
    return base if isinstance(base, fx.Node) else None


def in_place_writes(graph: fx.Graph) -> list[tuple[fx.Node, set[fx.Node]]]:
    """``(op, values)`` for every op that writes in place: ``values`` are the tensor it writes into and
    everything that may alias it (views of it and the values it is a view of, transitively)."""
    writes = []
    for node in graph.nodes:
        if not is_mutating(node):
            continue
        targets = [a for a in (node.args[:1] + tuple(v for k, v in node.kwargs.items() if k == "out"))
                   if isinstance(a, fx.Node)]
        aliases, stack = set(), targets
        while stack:
            n = stack.pop()
            if n in aliases:
                continue
            aliases.add(n)
            base = _may_alias(n)
            if base is not None:
                stack.append(base)
            stack.extend(u for u in n.users if _may_alias(u) is n)
        writes.append((node, aliases))
    return writes


def mutated_values(graph: fx.Graph) -> set[fx.Node]:
    """Every value some op writes into in place, with everything that may alias it."""
    return set().union(*(aliases for _, aliases in in_place_writes(graph)))


def eliminate_dead_code(graph: fx.Graph) -> None:
    """``graph.eliminate_dead_code()`` that also keeps in-place ops whose result is unused (FX keeps
    only the ones it knows; e.g. it drops ``x.scatter_(...)``, which would silently change the model)."""
    graph.eliminate_dead_code(is_impure_node=lambda n: n.is_impure() or is_mutating(n))


class NotConstant(Exception):
    pass


def evaluate_constant(gm: fx.GraphModule, node: fx.Node, max_numel: int = 2**28, at: fx.Node | None = None,
                      inputs: dict | None = None):
    """Evaluate ``node`` with real tensors if it depends only on constants and module buffers
    (never on the caller's inputs or on parameters); raises :class:`NotConstant` otherwise.

    The value is the one ``node`` holds when ``at`` (default: ``node`` itself) runs: in-place writes
    into it (or into what it aliases, or what it was computed from) made before ``at`` are replayed in
    graph order, e.g. HF's mask built by ``torch.full`` then edited with ``triu_`` / ``&=``.

    Buffers are read at compile time: a mask kept in a buffer (nanoGPT's ``tril``) is assumed not
    to change between calls.  ``inputs`` maps placeholders to values to evaluate with (probing a mask
    that depends on the caller's inputs)."""
    inputs = inputs or {}
    position = {n: i for i, n in enumerate(gm.graph.nodes)}
    cutoff = position[at if at is not None else node]
    writes = [(op, aliases) for op, aliases in in_place_writes(gm.graph) if position[op] < cutoff]
    needed = set(ancestors(node))
    grew = True
    while grew:  # the writes into needed values, and what those writes read
        grew = False
        for op, aliases in writes:
            if op not in needed and aliases & needed:
                needed.update(ancestors(op))
                grew = True
    order = [n for n in gm.graph.nodes if n in needed]
    env = {}
    for n in order:
        if n in inputs:
            env[n] = inputs[n]
            continue
        if n.op == "placeholder":
            if placeholder_kind(n) != "buffer":
                raise NotConstant(f"depends on the {placeholder_kind(n)} `{n.name}`")
            # a copy: replayed in-place writes must not reach the module's buffer
            example = placeholder_example(n)
            if example is None:
                raise NotConstant(f"no value recorded for buffer `{n.name}`")
            env[n] = example.detach().clone() if isinstance(example, torch.Tensor) else example
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
            attr = getattr(gm, n.target)
            env[n] = attr.detach().clone() if isinstance(attr, torch.Tensor) else attr
        else:
            raise NotConstant(f"cannot evaluate `{n.op}` node `{n.name}`")
    return env[node]


def normalized_kwargs(node: fx.Node) -> dict | None:
    """The call's arguments as keywords (``torch.fx``'s signature normalization), or None if it can't."""
    from torch.fx.operator_schemas import normalize_function

    normalized = normalize_function(node.target, node.args, node.kwargs, normalize_to_only_use_kwargs=True)
    return None if normalized is None else dict(normalized.kwargs)


def const_number(x):
    return x if isinstance(x, (int, float)) and not isinstance(x, bool) else None


def prod(xs) -> int:
    return math.prod(int(x) for x in xs)


__all__ = ["val", "fake_mode_of", "set_meta", "is_function", "is_method", "op_name", "placeholder_kind",
           "placeholder_example", "ancestors", "evaluate_constant", "NotConstant", "const_number", "prod",
           "is_mutating", "in_place_writes", "mutated_values", "eliminate_dead_code", "normalized_kwargs",
           "operator"]
