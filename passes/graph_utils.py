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


def dtype_name(dtype: torch.dtype | None) -> str | None:
    """``"bfloat16"`` for ``torch.bfloat16`` (report details), None for None."""
    return None if dtype is None else str(dtype).removeprefix("torch.")


def fake_mode_of(gm: fx.GraphModule):
    from torch._subclasses.fake_tensor import FakeTensor

    for node in gm.graph.nodes:
        v = val(node)
        if isinstance(v, FakeTensor):
            return v.fake_mode
    return None


def refresh_meta(gm: fx.GraphModule) -> None:
    """Recompute every node's example value after a rewrite (``meta['val']`` and ``example_value``), from the
    placeholders' (fake propagation over the whole graph)."""
    from torch.fx.passes.fake_tensor_prop import FakeTensorProp

    fake_mode = fake_mode_of(gm)
    inputs = [val(n) for n in gm.graph.nodes if n.op == "placeholder"]
    gm.recompile()
    FakeTensorProp(gm, fake_mode).propagate_dont_convert_inputs(*inputs)
    for node in gm.graph.nodes:
        if "val" in node.meta:
            node.meta["example_value"] = node.meta["val"]


def propagate_meta(nodes, fake_mode) -> None:
    """Example values for ``nodes`` only (new nodes, in graph order, whose inputs already have theirs): what
    :func:`refresh_meta` would give them, without re-running the whole graph (which costs ~0.6 s on a small
    model's backward, every compile)."""
    for node in nodes:
        set_meta(node, node.target, node.args, node.kwargs, fake_mode)
        if "example_value" in node.meta:
            node.meta["val"] = node.meta["example_value"]


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


def wrap_trained_parameters(graph: fx.Graph, fn, *args, fake_mode=None) -> int:
    """Every parameter placeholder that needs a gradient and is read: its readers read ``fn(param, *args)``
    instead (a node right after it; with ``fake_mode``, given its example value).  Returns how many."""
    wrapped = 0
    for node in list(graph.nodes):
        example = val(node)
        if node.op == "placeholder" and placeholder_kind(node) == "parameter" and example is not None \
                and example.requires_grad and node.users:
            with graph.inserting_after(node):
                wrapper = graph.call_function(fn, (node, *args))
            node.replace_all_uses_with(wrapper, delete_user_cb=lambda user: user is not wrapper)
            propagate_meta([wrapper], fake_mode)
            wrapped += 1
    return wrapped


def node_named(graph: fx.Graph, name: str) -> fx.Node:
    """The node called ``name`` (a mask term's runtime source: a placeholder, or a value computed from them)."""
    return next(n for n in graph.nodes if n.name == name)


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


def _state_ops() -> set:
    """Ops that change interpreter state and return nothing (no users): Dynamo records functorch's vmap
    levels around a vmapped region (``create_block_mask`` runs one) as such calls; FX does not know them."""
    import torch._functorch.predispatch as predispatch

    return {getattr(predispatch, name) for name in ("_vmap_increment_nesting", "_vmap_decrement_nesting",
                                                    "lazy_load_decompositions") if hasattr(predispatch, name)}


def eliminate_dead_code(graph: fx.Graph) -> None:
    """Remove what no output depends on, keeping every in-place write into a value something live reads
    (FX keeps only the writes it knows: it drops ``x.scatter_(...)``, which would silently change the model)
    and dropping writes into values nothing reads any more (a block mask built in place for an attention the
    shard pass replaced).  Calls that only change interpreter state (vmap levels) are kept."""
    state_ops = _state_ops()
    writes = in_place_writes(graph)
    live = set()

    def mark(root):
        stack = [root]
        while stack:
            n = stack.pop()
            if n in live:
                continue
            live.add(n)
            stack.extend(n.all_input_nodes)

    for n in graph.nodes:
        if n.op in ("output", "placeholder") or (n.op == "call_function" and n.target in state_ops) \
                or (n.is_impure() and not is_mutating(n)):
            mark(n)
    grew = True
    while grew:  # a write matters when a live node reads what it writes (or an alias of it)
        grew = False
        for op, aliases in writes:
            if op not in live and any(a in live for a in aliases if a is not op):
                readers = {u for a in aliases for u in a.users if u in live and u is not op}
                if readers or any(a.op == "placeholder" for a in aliases):
                    mark(op)
                    grew = True
    for n in reversed(list(graph.nodes)):
        if n not in live and not n.users:
            graph.erase_node(n)


class NotConstant(Exception):
    pass


class TooLarge(NotConstant):
    """The value could be computed but is too big to evaluate at compile time (at this length)."""


class NotScalable(NotConstant):
    """Evaluating at a shorter sequence length changed a shape in a way the substitution does not explain."""


# Compile-time evaluation of one tensor stops at this many elements (a [1, 1, S, S] mask: S = 16K); longer
# masks are evaluated at shorter lengths (LengthScaling)
FULL_EVALUATION_LIMIT = 2**28


class LengthScaling:
    """Evaluate a subgraph traced at sequence length ``full`` as if traced at the shorter ``probe``: every int
    argument ``full + k`` (|k| <= SLACK, e.g. ``arange(S)``, ``expand(B, 1, S, S)``, a slice end) becomes
    ``probe + k``.  Every computed value must then have its traced shape with the same substitution, else
    :class:`NotScalable`: some size came from the length another way (``S * S``, ``S // 2``), or another
    dimension equals the length by chance.  What this cannot check — a *value* threshold derived from the
    length — the caller checks by comparing two probe lengths."""

    SLACK = 2

    def __init__(self, full: int, probe: int):
        self.full, self.probe = full, probe

    def __repr__(self):
        return f"LengthScaling({self.full} -> {self.probe})"

    def is_length(self, x) -> bool:
        return isinstance(x, int) and not isinstance(x, bool) and abs(x - self.full) <= self.SLACK

    def size(self, x):
        return x - self.full + self.probe if self.is_length(x) else x

    def args(self, args):
        if isinstance(args, (tuple, list)):
            return type(args)(self.args(a) for a in args)
        if isinstance(args, dict):
            return {k: self.args(v) for k, v in args.items()}
        if isinstance(args, slice):
            return slice(self.size(args.start), self.size(args.stop), self.size(args.step))
        if isinstance(args, torch.Size):
            return torch.Size(self.size(d) for d in args)
        return self.size(args)

    def shape(self, shape) -> tuple:
        return tuple(self.size(int(d)) for d in shape)


def evaluation_order(gm: fx.GraphModule, node: fx.Node, at: fx.Node | None = None) -> list[fx.Node]:
    """The nodes :func:`evaluate_constant` computes for ``node`` as read by ``at``, in graph order: its
    ancestors, the in-place writes into them made before ``at``, and what those writes read."""
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
    return [n for n in gm.graph.nodes if n in needed]


def input_dependency(gm: fx.GraphModule, node: fx.Node, at: fx.Node | None = None) -> fx.Node | None:
    """The first placeholder ``node``'s value (as ``at`` reads it) depends on that is not a module buffer — a
    caller's input or a parameter — else None: the value is a compile-time constant."""
    return next((n for n in evaluation_order(gm, node, at)
                 if n.op == "placeholder" and placeholder_kind(n) != "buffer"), None)


def evaluate_constant(gm: fx.GraphModule, node: fx.Node, max_numel: int | None = None,
                      at: fx.Node | None = None, inputs: dict | None = None, length: LengthScaling | None = None):
    """Evaluate ``node`` with real tensors if it depends only on constants and module buffers
    (never on the caller's inputs or on parameters); raises :class:`NotConstant` otherwise.

    The value is the one ``node`` holds when ``at`` (default: ``node`` itself) runs: in-place writes
    into it (or into what it aliases, or what it was computed from) made before ``at`` are replayed in
    graph order, e.g. HF's mask built by ``torch.full`` then edited with ``triu_`` / ``&=``.

    Buffers are read at compile time: a mask kept in a buffer (nanoGPT's ``tril``) is assumed not
    to change between calls.  ``inputs`` maps placeholders to values to evaluate with (probing a mask
    that depends on the caller's inputs).  ``length`` evaluates at a shorter sequence length (see
    :class:`LengthScaling`); a value over ``max_numel`` (default :data:`FULL_EVALUATION_LIMIT`) elements
    raises :class:`TooLarge`."""
    inputs = inputs or {}
    max_numel = FULL_EVALUATION_LIMIT if max_numel is None else max_numel
    env = {}
    order = evaluation_order(gm, node, at)
    # each value is dropped after its last reader: a [1, 1, S, S] mask at S = 16K is 1 GiB in fp32 per
    # intermediate, so a chain of them holds a few at a time instead of all (measured: 1.3 GiB peak for HF Llama's)
    last_reader = {}
    for index, n in enumerate(order):
        for arg in n.all_input_nodes:
            last_reader[arg] = index
    for index, n in enumerate(order):
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
        traced = val(n)
        expected = None
        if isinstance(traced, torch.Tensor) and n.op != "get_attr":  # a get_attr constant keeps its shape
            expected = length.shape(traced.shape) if length is not None else tuple(traced.shape)
            if math.prod(expected) > max_numel:
                raise TooLarge(f"`{n.name}` has {math.prod(expected):,} elements, too many to evaluate at compile "
                               "time")
        args = fx.node.map_arg(n.args, lambda a: env[a])
        kwargs = fx.node.map_arg(n.kwargs, lambda a: env[a])
        if length is not None:
            args, kwargs = length.args(args), length.args(kwargs)
        if n.op == "call_function":
            env[n] = n.target(*args, **kwargs)
        elif n.op == "call_method":
            env[n] = getattr(args[0], n.target)(*args[1:], **kwargs)
        elif n.op == "get_attr":
            attr = getattr(gm, n.target)
            env[n] = attr.detach().clone() if isinstance(attr, torch.Tensor) else attr
        else:
            raise NotConstant(f"cannot evaluate `{n.op}` node `{n.name}`")
        if length is not None and expected is not None and isinstance(env[n], torch.Tensor) \
                and tuple(env[n].shape) != expected:
            raise NotScalable(f"`{n.name}`: shape {tuple(traced.shape)} at length {length.full} is "
                              f"{tuple(env[n].shape)} at {length.probe}, not {expected}")
        for arg in n.all_input_nodes:
            if last_reader.get(arg) == index and arg is not node:
                env.pop(arg, None)
    return env[node]


def numeric_constants(gm: fx.GraphModule, nodes) -> list[float]:
    """The numbers ``nodes`` compute with that are not tensors' contents: int/float arguments (in tuples,
    slices, keywords) and the entries of small constant tensors (``get_attr`` of at most 64 elements)."""
    found = []

    def visit(a):
        if isinstance(a, bool):
            return
        if isinstance(a, (int, float)):
            found.append(a)
        elif isinstance(a, (tuple, list)):
            for x in a:
                visit(x)
        elif isinstance(a, dict):
            for x in a.values():
                visit(x)
        elif isinstance(a, slice):
            visit((a.start, a.stop, a.step))

    for n in nodes:
        if n.op == "get_attr":
            attr = getattr(gm, n.target, None)
            if isinstance(attr, torch.Tensor) and attr.numel() <= 64 and not attr.is_complex():
                found.extend(float(x) for x in attr.detach().flatten().tolist())
        else:
            visit(n.args)
            visit(n.kwargs)
    return found


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
           "placeholder_example", "ancestors", "evaluate_constant", "NotConstant", "TooLarge", "NotScalable",
           "LengthScaling", "FULL_EVALUATION_LIMIT", "evaluation_order", "input_dependency", "numeric_constants",
           "const_number", "prod",
           "is_mutating", "in_place_writes", "mutated_values", "eliminate_dead_code", "normalized_kwargs",
           "operator"]
