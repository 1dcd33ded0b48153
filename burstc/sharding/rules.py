"""The shard analysis's op rules, one per op family, in three ordered tables.

A rule is ``apply(analyzer, node) -> Placement`` behind a ``matches(analyzer, node)`` test; it may record
rewrites in ``analyzer.plan`` (inputs to shard, new shape arguments, attention and loss nodes) or raise
:class:`~burstc.refusals.Refused` with a :data:`~burstc.sharding.codes.CODES` code.  The analyzer picks
the table from the node's input placements and applies the first rule that matches:

- :data:`REPLICATED_RULES`: every input replicated (where indices become activations);
- :data:`SHARDED_RULES`: some input sharded along one dim (or a tuple of such);
- :data:`MERGED_RULES`: some input has merged (batch, sequence) rows.

The order inside a table is part of the semantics (e.g. a dtype ``view`` before a reshaping one).

Longer than ~400 lines because it is the whole rule table: some thirty short rules, read together since
their order is part of what they mean; ``tests/test_shard_rules.py`` checks them one process, no ranks.
"""
from __future__ import annotations

import math
import operator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable

import torch
import torch.fx as fx
import torch.nn.functional as F

from burstc.attention_ir import Documents
from burstc.ops.linear_cross_entropy import linear_cross_entropy
from burstc.passes.detect_attention import SDPA, attention_call, sdpa_kwargs
from burstc.passes.graph_utils import is_function, is_method, is_mutating, node_named, normalized_kwargs, op_name, \
    prod, val
from burstc.refusals import Refused
from burstc.sharding.codes import CODES
from burstc.sharding.placements import REPLICATE, GroupSizes, MergedRows, Permuted, Placement, RowIndex, Shard, \
    TuplePlacement, at_dim, factors, is_sharded, rows

if TYPE_CHECKING:
    from burstc.sharding.analysis import Analyzer

POINTWISE_FUNCTIONS = {
    operator.add, operator.sub, operator.mul, operator.truediv, operator.floordiv, operator.mod, operator.neg,
    operator.pow, operator.and_, operator.or_, operator.eq, operator.ne, operator.lt, operator.le, operator.gt,
    operator.ge, operator.invert, operator.iadd, operator.isub, operator.imul, operator.itruediv,
    torch.add, torch.sub, torch.mul, torch.div, torch.neg, torch.exp, torch.log, torch.tanh, torch.sigmoid,
    torch.rsqrt, torch.sqrt, torch.sin, torch.cos, torch.where, torch.pow, torch.abs, torch.clamp, torch.erf,
    torch.square, torch.reciprocal, torch.maximum, torch.minimum, torch.relu,
    F.silu, F.gelu, F.relu, F.sigmoid, F.tanh, F.softplus, F.leaky_relu, F.mish, F.elu,
    torch.expm1, torch.log1p, torch.polar, torch.sign, torch.floor, torch.ceil, torch.round, torch.trunc, torch.erfc,
    torch.atan, torch.atan2, torch.log2, torch.exp2, torch.sinh, torch.cosh, torch.logical_not, torch.logical_and,
    torch.logical_or, torch.isnan, torch.isinf, torch.nan_to_num, torch.lerp, torch.addcmul, torch.addcdiv,
    torch.clip, torch.fmod, torch.remainder, torch.true_divide,
    F.hardtanh, F.hardswish, F.hardsigmoid, F.selu, F.celu, F.logsigmoid, F.softsign, F.relu6,
}
POINTWISE_METHODS = {
    "float", "half", "bfloat16", "double", "to", "type", "type_as", "contiguous", "clone", "detach", "sin", "cos",
    "exp", "log", "pow", "neg", "sigmoid", "tanh", "rsqrt", "sqrt", "masked_fill", "add", "mul", "sub", "div",
    "abs", "clamp", "relu", "square", "reciprocal", "__mul__", "__add__", "__sub__", "__truediv__", "float_power",
    "expm1", "log1p", "sign", "floor", "ceil", "round", "trunc", "erf", "clip", "lerp", "addcmul", "nan_to_num",
    "logical_not", "isnan", "where", "minimum", "maximum", "__neg__", "__rsub__", "__radd__", "__rmul__",
    "__rtruediv__", "bool", "int", "long",
}
UNARY_FIRST_ARG_METHODS = {"to", "type", "type_as"}  # other args are dtype/device sources
REDUCTIONS = {"mean", "sum", "amax", "amin", "var", "std", "norm", "logsumexp", "prod", "argmax", "argmin"}
NO_TENSOR_SIDE_EFFECT = {"_log_api_usage_once"}


@dataclass(frozen=True)
class Rule:
    """``apply`` for the ops ``matches`` accepts; ``family`` names it in tables and tests."""
    family: str
    matches: Callable[[Analyzer, fx.Node], bool]
    apply: Callable[[Analyzer, fx.Node], Placement]

    def __call__(self, analyzer: Analyzer, node: fx.Node) -> Placement:
        return self.apply(analyzer, node)


def rule(family: str, matches: Callable[[Analyzer, fx.Node], bool]):
    """Make the decorated ``apply(analyzer, node)`` a :class:`Rule`; the tables at the end order them."""
    return lambda apply: Rule(family, matches, apply)


def norm_dim(d: int, ndim: int) -> int:
    return d % ndim if ndim else d


def first_arg(node: fx.Node):
    return node.args[0] if node.args else None


def on_functions(*targets):
    return lambda analyzer, node: is_function(node, *targets)


def on_methods(*names):
    return lambda analyzer, node: is_method(node, *names)


def on_ops(functions=(), methods=()):
    return lambda analyzer, node: is_function(node, *functions) or is_method(node, *methods)


def is_pointwise(analyzer, node) -> bool:
    return (node.op == "call_function" and node.target in POINTWISE_FUNCTIONS) or \
        (node.op == "call_method" and node.target in POINTWISE_METHODS)


# -- every table ------------------------------------------------------------------------------------
@rule("side_effect_free", lambda analyzer, node: node.op == "call_function"
      and getattr(node.target, "__name__", "") in NO_TENSOR_SIDE_EFFECT)
def side_effect_free(analyzer, node):
    return REPLICATE


# -- in-place writes -------------------------------------------------------------------------------
def writes_into_replicated(analyzer, node) -> bool:
    written = first_arg(node)
    return is_mutating(node) and (not isinstance(written, fx.Node) or not is_sharded(analyzer.place(written)))


@rule("inplace", writes_into_replicated)
def refuse_inplace_write(analyzer, node):
    # the write would land in a sharded copy while later readers see the replicated original
    raise Refused(CODES.inplace_write, f"in-place `{op_name(node)}` writes sharded values into a replicated tensor",
                  node)


# -- losses and attention --------------------------------------------------------------------------
@rule("fused_loss", on_functions(linear_cross_entropy))
def fused_loss(analyzer, node):
    hidden, weight, target = node.args[:3]
    placement = analyzer.place(hidden)
    if not is_sharded(placement):
        return REPLICATE
    if is_sharded(analyzer.place(target)):
        raise Refused(CODES.loss_targets, "loss targets are already sharded", node)
    if placement.dim == val(hidden).dim() - 1:
        raise Refused(CODES.loss_arguments, "hidden states sharded along the hidden dim", node)
    if tuple(val(target).shape) != tuple(val(hidden).shape[:-1]):
        raise Refused(CODES.loss_targets, "loss targets do not have the hidden states' token shape", node)
    analyzer.plan.losses.append(node)
    return REPLICATE  # the all-reduce inserted after it makes the loss replicated


UNFUSED_LOSSES = (F.cross_entropy, F.nll_loss)
"""The losses on logits the ``cross_entropy`` rule shards (the shard pass rewrites these plan losses)."""


@rule("cross_entropy", on_functions(*UNFUSED_LOSSES))
def cross_entropy(analyzer, node):
    """``F.cross_entropy`` (or ``F.nll_loss`` of log-probabilities) on sharded logits that the LM-head fusion left
    alone (e.g. logits scaled between the head and the loss, or the fusion switched off): per-token losses on the
    local rows, gathered, then the requested reduction on the full, replicated vector (see the pass's rewrite).
    The logits are ``[tokens, classes]`` with the tokens sharded (merged batch rows allowed), or CE's sequence
    layout ``[B, classes, S]`` sharded along S with ``[B, S]`` targets."""
    name = node.target.__name__
    kw = normalized_kwargs(node)
    if kw is None:
        raise Refused(CODES.loss_arguments, f"could not normalize the {name} call on sharded logits", node)
    logits, target = kw["input"], kw["target"]
    if kw.get("weight") is not None:
        raise Refused(CODES.loss_arguments, f"{name} with class weights on sharded logits", node)
    if kw.get("size_average") is not None or kw.get("reduce") is not None:
        raise Refused(CODES.loss_arguments, f"{name} with the legacy size_average/reduce arguments", node)
    if kw.get("reduction", "mean") not in ("mean", "sum", "none"):
        raise Refused(CODES.loss_arguments, f"{name} reduction {kw.get('reduction')!r}", node)
    if not isinstance(kw.get("ignore_index", -100), int):
        raise Refused(CODES.loss_arguments, f"{name} ignore_index is not a constant", node)
    logits_val, target_val = val(logits), val(target)
    placement = analyzer.place(logits)
    if is_sharded(analyzer.place(target)):
        raise Refused(CODES.loss_targets, f"{name} targets are already sharded", node)
    if logits_val.dim() == 3 and placement == Shard(2):  # [B, classes, S]: the targets are [B, S]
        if tuple(target_val.shape) != (logits_val.shape[0], analyzer.S) or target_val.dtype.is_floating_point:
            raise Refused(CODES.loss_targets, f"{name} targets are not [B, S] class indices", node)
        analyzer.plan.merged_rows[node] = None  # CE's [B, classes, S] layout: no batch rows merged into tokens
        analyzer.plan.losses.append(node)
        return REPLICATE
    batch_rows = placement.outer if isinstance(placement, MergedRows) and placement.dim == 0 \
        and placement.inner == 1 else 1 if placement == Shard(0) else None
    if logits_val.dim() != 2 or batch_rows is None:
        raise Refused(CODES.loss_arguments, f"{name} on sharded logits that are not [tokens, classes] with "
                                            "the tokens sharded, nor [B, classes, S] sharded along S", node)
    if target_val.dim() != 1 or target_val.shape[0] != batch_rows * analyzer.S or target_val.dtype.is_floating_point:
        raise Refused(CODES.loss_targets, f"{name} targets are not class indices, one per token of the batch",
                      node)
    analyzer.plan.merged_rows[node] = batch_rows
    analyzer.plan.losses.append(node)
    return REPLICATE  # the per-token losses are gathered: the loss is replicated


@rule("attention", lambda analyzer, node: is_function(node, SDPA) or node in analyzer.attention_matches)
def attention(analyzer, node):
    """Attention on sharded [B, H, S, D] operands whose mask the ring executes (detect_attention's match
    says which: an SDPA node, or a manual attention left as written, e.g. soft-capped): becomes ring
    attention in the rewrite."""
    match = analyzer.attention_matches.get(node)  # detect_attention's AttentionMatch, when it ran
    call = attention_call(node, match)
    q, k, v = call.query, call.key, call.value
    if match is not None and not match.shardable:
        reason = match.refusal.reason if match.refusal else f"a {match.mask.kind} mask"
        raise Refused(CODES.attention_mask,
                      f"attention with {reason} (masks are not supported by the ring op yet)", node)
    if match is None and call.attn_mask is not None:
        raise Refused(CODES.attention_mask,
                      "attention with an attention mask (masks are not supported by the ring op yet)", node)
    if call.dropout_p:
        raise Refused(CODES.dropout_in_training, "attention dropout > 0", node)
    documents = match.mask.term(Documents) if match is not None else None
    if documents is not None:
        # the ring op takes the whole batch's ids on every rank: a value the model computes from its token inputs
        # is that only while it stays replicated (never, e.g., after ``ids.float()`` shards it)
        source = node_named(analyzer.gm.graph, documents.source)
        if analyzer.place(source) != REPLICATE:
            raise Refused(CODES.attention_mask, f"the mask's document ids `{source.name}` are a sharded value "
                                                f"({analyzer.place(source)}), not the whole batch's on every rank",
                          node)
    for t in (q, k, v):
        if not is_sharded(analyzer.place(t)):
            raise Refused(CODES.attention_operands, f"attention operand `{t.name}` is not sharded", node)
        if analyzer.place(t) != Shard(val(t).dim() - 2) or val(t).dim() != 4:
            raise Refused(CODES.attention_operands,
                          "attention operands are not [B, H, S, D] with the sequence in dim 2", node)
    analyzer.plan.attention.append(node)
    return Shard(2)


# -- where token indices become activations ----------------------------------------------------------
@rule("embedding", on_functions(F.embedding, torch.embedding))
def embedding(analyzer, node):
    """``embedding(ids)`` shards replicated ids along their sequence dim first (``burstc::shard_seq``)."""
    ids = node.args[0] if node.target is F.embedding else node.args[1]
    if is_sharded(analyzer.place(ids)):
        return analyzer.place(ids)
    dims = analyzer.seq_dims(val(ids))
    if not dims:
        return REPLICATE
    analyzer.shard_input(node, ids, dims[-1])
    return Shard(dims[-1])


def converts_positions_to_float(analyzer, node) -> bool:
    """``positions.float()``: an integer value with one sequence dim, from the token inputs or ``arange(S)``."""
    v, source = val(node), first_arg(node)
    return (is_method(node, "float", "to", "type_as", "half", "bfloat16") and bool(analyzer.tensor_args(node))
            and isinstance(v, torch.Tensor) and v.is_floating_point()
            and not val(source).is_floating_point() and len(analyzer.seq_dims(val(source))) == 1
            and analyzer.position_like(source))


@rule("positions_to_float", converts_positions_to_float)
def positions_to_float(analyzer, node):
    dim = analyzer.seq_dims(val(node.args[0]))[0]
    analyzer.shard_input(node, node.args[0], dim)
    return Shard(dim)


# -- tuples ------------------------------------------------------------------------------------------
@rule("tuple_item", lambda analyzer, node: is_function(node, operator.getitem)
      and isinstance(analyzer.place(first_arg(node)), TuplePlacement))
def tuple_item(analyzer, node):
    return analyzer.place(node.args[0])[node.args[1]]


@rule("tuple_operand", lambda analyzer, node: any(
    isinstance(analyzer.place(a), TuplePlacement) for a in analyzer.tensor_args(node)))
def refuse_tuple_operand(analyzer, node):
    raise Refused(CODES.unsupported_op, f"`{op_name(node)}` takes a tuple of sharded values", node)


# -- indexing and slicing ----------------------------------------------------------------------------
@rule("indexing", on_functions(operator.getitem))
def indexing(analyzer, node):
    """``x[index]`` keeps the sequence dim whole (full slices only); ``...`` and ``None`` move it."""
    x, index = node.args[:2]
    items = list(index) if isinstance(index, tuple) else [index]
    ndim = val(x).dim()
    if any(isinstance(i, fx.Node) for i in items):
        raise Refused(CODES.slices_sequence, "tensor indexing of a sharded value", node)
    d = analyzer.place(x).dim
    n_consuming = sum(1 for i in items if i is not None and i is not Ellipsis)
    expanded = []
    for i in items:
        if i is Ellipsis:
            expanded.extend([slice(None)] * (ndim - n_consuming))
        else:
            expanded.append(i)
    expanded.extend([slice(None)] * (ndim - sum(1 for i in expanded if i is not None)))
    in_dim, out_dim, new_items, result = 0, 0, [], None
    for i in expanded:
        if i is None:
            out_dim += 1
            new_items.append(None)
            continue
        if in_dim == d:
            full = isinstance(i, slice) and i.step in (None, 1) and (i.start in (None, 0)) \
                and (i.stop is None or i.stop >= analyzer.S)
            if not full:
                raise Refused(CODES.slices_sequence, "slices or indexes the sequence dim", node)
            result = out_dim
            new_items.append(slice(None))
        else:
            new_items.append(i)
        if not isinstance(i, int):
            out_dim += 1
        in_dim += 1
    new_index = tuple(new_items) if isinstance(index, tuple) else new_items[0]
    if new_index != index:
        analyzer.plan.new_args[node] = ((x, new_index), dict(node.kwargs))
    return at_dim(analyzer.place(x), result)


def tensor_index(node):
    """``(x, index)`` of ``x[index]`` where ``index`` indexes dim 0 with one tensor (``x[i]``, ``x[i, :]``,
    ``x[i, ...]``), else None."""
    if not is_function(node, operator.getitem):
        return None
    x, index = node.args[:2]
    items = list(index) if isinstance(index, tuple) else [index]
    if not items or not isinstance(items[0], fx.Node) or not isinstance(val(items[0]), torch.Tensor):
        return None
    if any(i is not Ellipsis and i != slice(None) for i in items[1:]):
        return None
    return x, items[0]


@rule("gather_rows", lambda analyzer, node: tensor_index(node) is not None)
def gather_rows(analyzer, node):
    """``x[index]`` along dim 0: rows gathered by this rank's own row numbers (:class:`RowIndex`: a sort's
    indices, their inverse), or a replicated table looked up per token row (expert weights by expert id).
    Any other tensor index into sharded rows would read other ranks' rows: refused."""
    x, index = tensor_index(node)
    where, by = analyzer.place(x), analyzer.place(index)
    if isinstance(by, RowIndex):
        if val(index).dim() != 1 or where != at_dim(by.target, 0):
            raise Refused(CODES.slices_sequence, f"`{index.name}` numbers rows of a value placed {by.target}, "
                                                 f"not of `{x.name}` ({where})", node)
        return at_dim(by.order, 0)
    if not is_sharded(where) and isinstance(by, (Shard, MergedRows, Permuted)) \
            and not val(index).dtype.is_floating_point and val(index).dtype is not torch.bool:
        return by  # the index's dims replace x's dim 0, rows where they were
    raise Refused(CODES.slices_sequence, "tensor indexing of a sharded value", node)


@rule("topk_sort", on_ops((torch.topk, torch.sort, torch.argsort), ("topk", "sort", "argsort")))
def topk_sort(analyzer, node):
    """Along another dim than the rows: each row alone (a router's top-k experts).  A sort of 1-D token rows
    along them: the sorted values are :class:`Permuted` by this node, its indices the :class:`RowIndex` that
    made them (a mixture of experts grouping token slots by expert, each rank its own)."""
    x = first_arg(node)
    placement, v = analyzer.place(x), val(x)
    topk = is_function(node, torch.topk) or is_method(node, "topk")
    default_dim = -1
    dim = node.kwargs.get("dim", node.args[2 if topk else 1] if len(node.args) > (2 if topk else 1) else default_dim)
    if not isinstance(dim, int):
        raise Refused(CODES.unsupported_op, f"`{op_name(node)}` with a non-constant dim", node)
    argsort = is_function(node, torch.argsort) or is_method(node, "argsort")
    if norm_dim(dim, v.dim()) != placement.dim:
        return placement if argsort else TuplePlacement((placement, placement))
    if topk or v.dim() != 1 or not isinstance(placement, (Shard, MergedRows)):
        raise Refused(CODES.mixes_positions, f"`{op_name(node)}` across the sequence", node)
    order = Permuted(placement, node.name)
    indices = RowIndex(target=placement, order=order)
    return indices if argsort else TuplePlacement((order, indices))


# -- pointwise ---------------------------------------------------------------------------------------
@rule("pointwise", is_pointwise)
def pointwise_op(analyzer, node):
    if node.op == "call_method" and node.target in UNARY_FIRST_ARG_METHODS:
        return analyzer.place(first_arg(node))
    return pointwise(analyzer, node, analyzer.tensor_args(node))


def pointwise(analyzer, node, operands) -> Placement:
    """Broadcasting elementwise op: all sharded operands must agree; a replicated operand with the full S
    on the aligned dim is sharded there (RoPE tables), one of extent 1 broadcasts, anything else refuses."""
    n = val(node).dim()
    placements = {analyzer.place(a).shifted(n - val(a).dim()) for a in operands if is_sharded(analyzer.place(a))}
    if not placements:
        return REPLICATE
    if len(placements) > 1:
        raise Refused(CODES.misaligned_operands, "operands sharded along different dims", node)
    out = placements.pop()
    for a in operands:
        if is_sharded(analyzer.place(a)):
            continue
        k = val(a).dim()
        aligned = out.dim - (n - k)
        if 0 <= aligned < k and val(a).shape[aligned] == analyzer.S and isinstance(out, Shard):
            analyzer.shard_input(node, a, aligned)
        elif 0 <= aligned < k and isinstance(out, MergedRows) \
                and val(a).shape[aligned] == out.outer * analyzer.S * out.inner:
            analyzer.shard_input(node, a, (aligned, out.outer, out.inner))  # e.g. HF's flat attention mask
        elif 0 <= aligned < k and val(a).shape[aligned] != 1:
            raise Refused(CODES.misaligned_operands,
                          f"replicated operand `{a.name}` does not line up with the sequence", node)
    return out


POINTWISE_INPLACE_METHODS = {"add_", "sub_", "mul_", "div_", "masked_fill_", "clamp_", "copy_", "neg_", "exp_",
                             "tanh_", "sigmoid_", "relu_", "pow_", "fill_", "zero_"}


@rule("pointwise_inplace", on_methods(*POINTWISE_INPLACE_METHODS))
def pointwise_inplace(analyzer, node):
    """``x.add_(y)`` on a sharded ``x`` (a replicated one was refused first): elementwise on this rank's rows,
    the result placed as ``x`` is."""
    placement = pointwise(analyzer, node, analyzer.tensor_args(node))
    if placement != analyzer.place(first_arg(node)):
        raise Refused(CODES.misaligned_operands, f"in-place `{op_name(node)}` would change where its tensor's "
                                                 "rows are", node)
    return placement


# -- a custom autograd.Function that is pointwise both ways (BLOOM's GELU) --------------------------------------
_GRAD_MODE_CALLS = {torch._C._set_grad_enabled}


def _body_is_pointwise(body: fx.GraphModule) -> bool:
    """Every op of ``body`` is elementwise (or a grad-mode switch): its tokens stay independent."""
    return all(node.op not in ("call_function", "call_method", "call_module") or is_pointwise(None, node)
               or (node.op == "call_function" and node.target in _GRAD_MODE_CALLS) for node in body.graph.nodes)


def _is_pointwise_autograd_function(analyzer, node) -> bool:
    if not (node.op == "call_function" and node.target is torch.ops.higher_order.autograd_function_apply):
        return False
    bodies = [getattr(analyzer.gm, b.target, None) if isinstance(b, fx.Node) and b.op == "get_attr" else None
              for b in node.args[:2]]
    return all(isinstance(b, fx.GraphModule) and _body_is_pointwise(b) for b in bodies)


@rule("pointwise_autograd_function", _is_pointwise_autograd_function)
def pointwise_autograd_function(analyzer, node):
    """``autograd_function_apply(fwd, bwd, *args)`` with elementwise forward and backward bodies: each output
    item placed like its equally shaped inputs (all placed alike)."""
    tensors = [a for a in node.args[2:] if isinstance(a, fx.Node) and isinstance(val(a), torch.Tensor)]
    places = {analyzer.place(a) for a in tensors}
    shapes = {tuple(val(a).shape) for a in tensors}
    outputs = val(node) if isinstance(val(node), (tuple, list)) else (val(node),)
    if len(places) != 1 or len(shapes) != 1 or any(tuple(o.shape) not in shapes for o in outputs):
        raise Refused(CODES.unsupported_op, "a custom autograd function over differently placed or shaped "
                                            "inputs", node)
    return TuplePlacement((places.pop(),) * len(outputs))


@rule("like_constructor", on_functions(torch.ones_like, torch.zeros_like, torch.full_like, torch.empty_like))
def like_constructor(analyzer, node):
    placement = analyzer.place(first_arg(node))
    if isinstance(placement, GroupSizes):
        return REPLICATE  # shaped as on one device; a constant, not this rank's counts
    # a fresh tensor shaped like this rank's tokens (like row numbers: laid out as they are, holding no numbers)
    return placement.order if isinstance(placement, RowIndex) else placement


@rule("new_constructor", on_methods("new_empty", "new_zeros", "new_ones", "new_full"))
def new_constructor(analyzer, node):
    """``x.new_empty(*shape)`` shaped like ``x`` up to and including its rows (DeepSeek's MLA builds its keys so):
    a fresh tensor of this rank's rows; the shape constants become local ones."""
    x, v = first_arg(node), val(node)
    placement = analyzer.place(x)
    d = placement.dim
    if isinstance(placement, Permuted) or v.dim() <= d or tuple(v.shape[:d + 1]) != tuple(val(x).shape[:d + 1]) \
            or any(isinstance(a, fx.Node) for a in node.args[1:]):
        raise Refused(CODES.unsupported_op, f"`{op_name(node)}` not shaped like its tensor's rows", node)
    local = tuple(analyzer.local_shape(v, placement))
    fill = (node.args[-1],) if is_method(node, "new_full") else ()
    analyzer.plan.new_args[node] = ((x, local) + fill, dict(node.kwargs))
    return placement


@rule("one_hot", on_functions(F.one_hot))
def one_hot(analyzer, node):
    return analyzer.place(first_arg(node))  # a trailing class dim per element


@rule("gather_scatter", on_ops((torch.gather, torch.scatter, torch.scatter_add),
                               ("gather", "scatter", "scatter_", "scatter_add", "scatter_add_")))
def gather_scatter(analyzer, node):
    """``gather/scatter(x, dim, index[, src])`` along another dim than the rows, every tensor operand placed
    alike: each row alone (a router's grouped top-k)."""
    x = first_arg(node)
    dim = node.kwargs.get("dim", node.args[1] if len(node.args) > 1 else None)
    tensors = analyzer.tensor_args(node)
    places = {analyzer.place(t) for t in tensors}
    if not isinstance(dim, int) or len(places) != 1 or len({val(t).dim() for t in tensors}) != 1:
        raise Refused(CODES.misaligned_operands, f"`{op_name(node)}` with differently placed operands", node)
    placement = places.pop()
    if norm_dim(dim, val(x).dim()) == placement.dim:
        raise Refused(CODES.mixes_positions, f"`{op_name(node)}` along the sequence dim", node)
    return placement


@rule("min_max", on_ops((torch.min, torch.max), ("min", "max")))
def min_max(analyzer, node):
    """``min/max(a, b)``: pointwise; ``min/max(x, dim)``: (values, indices) reduced over ``dim``."""
    args, kwargs = node.args, node.kwargs
    x = first_arg(node)
    other = kwargs.get("other", args[1] if len(args) > 1 else None)
    if isinstance(other, fx.Node) and isinstance(val(other), torch.Tensor):
        return pointwise(analyzer, node, analyzer.tensor_args(node))
    dim = kwargs.get("dim", other)
    if not isinstance(dim, int):
        raise Refused(CODES.reduces_sequence, f"`{op_name(node)}` reduces over all dims, including the sequence",
                      node)
    dim = norm_dim(dim, val(x).dim())
    d = analyzer.place(x).dim
    if dim == d:
        raise Refused(CODES.reduces_sequence, f"`{op_name(node)}` reduces over the sequence dim", node)
    keepdim = kwargs.get("keepdim", args[2] if len(args) > 2 else False)
    out = at_dim(analyzer.place(x), d if keepdim or dim > d else d - 1)
    return TuplePlacement((out, out))


# -- position-wise: dropout, linear, norms (they act on each token alone) --------------------------------
@rule("dropout", on_functions(F.dropout))
def dropout(analyzer, node):
    args, kwargs = node.args, node.kwargs
    p = kwargs.get("p", args[1] if len(args) > 1 else 0.5)
    training = kwargs.get("training", args[2] if len(args) > 2 else True)
    if training and p > 0:
        raise Refused(CODES.dropout_in_training, "dropout > 0 in training (random masks can't match one device)",
                      node)
    return analyzer.place(first_arg(node))


@rule("linear", on_functions(F.linear, torch._C._nn.linear))
def linear(analyzer, node):
    x = first_arg(node)
    placement = analyzer.place(x)
    if is_sharded(placement) and placement.dim == val(x).dim() - 1:
        raise Refused(CODES.mixes_positions, "linear over the sequence dim", node)
    return placement


@rule("norm", lambda analyzer, node: node.op == "call_function"
      and getattr(node.target, "__name__", "") in ("layer_norm", "rms_norm"))
def norm(analyzer, node):
    args, kwargs = node.args, node.kwargs
    x = first_arg(node)
    placement = analyzer.place(x)
    shape = args[1] if len(args) > 1 else kwargs.get("normalized_shape")
    n_norm = len(shape) if isinstance(shape, (list, tuple)) else 1
    if placement.dim >= val(x).dim() - n_norm:
        raise Refused(CODES.mixes_positions, "normalization over the sequence dim", node)
    return placement


# -- softmax and reductions --------------------------------------------------------------------------
@rule("softmax", on_ops((torch.softmax, F.softmax, torch.log_softmax, F.log_softmax), ("softmax", "log_softmax")))
def softmax(analyzer, node):
    x = first_arg(node)
    placement = analyzer.place(x)
    dim = node.kwargs.get("dim", node.args[1] if len(node.args) > 1 else None)
    if dim is None or norm_dim(dim, val(x).dim()) == placement.dim:
        raise Refused(CODES.mixes_positions, "softmax over the sequence dim", node)
    return placement


@rule("reduction", lambda analyzer, node: is_method(node, *REDUCTIONS) or (
    node.op == "call_function" and getattr(node.target, "__name__", "") in REDUCTIONS))
def reduction(analyzer, node):
    args, kwargs = node.args, node.kwargs
    x = first_arg(node)
    dims = kwargs.get("dim", args[1] if len(args) > 1 else None)
    keepdim = kwargs.get("keepdim", args[2] if len(args) > 2 else False)
    d = analyzer.place(x).dim
    if dims is not None:
        dims = [norm_dim(i, val(x).dim()) for i in (dims if isinstance(dims, (list, tuple)) else [dims])]
    over_sequence, name = dims is None or d in dims, op_name(node).lstrip(".")
    if over_sequence and name == "sum":
        return sum_over_ranks(analyzer, node, "a sum over the sequence")
    if over_sequence and name == "mean":
        if not isinstance(val(x).numel(), int):
            raise Refused(CODES.reduces_sequence, f"`{op_name(node)}` over a symbolic-length sequence", node)
        # a mean over every token = the sum over the ranks / the whole count (the shapes here are unsharded)
        shape = val(x).shape
        analyzer.plan.means_over_ranks[node] = math.prod(shape) if dims is None else math.prod(shape[i] for i in dims)
        return sum_over_ranks(analyzer, node, "a mean over the sequence")
    if dims is None:
        raise Refused(CODES.reduces_sequence, f"`{op_name(node)}` reduces over all dims, including the sequence",
                      node)
    if d in dims:
        raise Refused(CODES.reduces_sequence, f"`{op_name(node)}` reduces over the sequence dim", node)
    return at_dim(analyzer.place(x), d if keepdim else d - sum(1 for i in dims if i < d))


def sum_over_ranks(analyzer, node, what: str, summed=0, fill: float = 0.0):
    """A sum over every token (with its other dims, or of counts): this rank's part now, summed over the ranks by
    the rewrite right after the node, so the value is replicated.  When the layout pads the sequence, the rows it
    pads in would count too: the rewrite first puts ``fill`` at those rows of the argument ``summed`` (an index or
    a keyword), which must be laid out as the token rows."""
    if analyzer.padded_len != analyzer.S:
        x = node.args[summed] if isinstance(summed, int) and summed < len(node.args) else node.kwargs.get(summed)
        where = analyzer.place(x) if isinstance(x, fx.Node) else None
        if not isinstance(where, (Shard, MergedRows)):
            raise Refused(CODES.reduces_sequence, f"{what} (`{op_name(node)}`) while the layout pads the sequence "
                                                  f"({analyzer.S} -> {analyzer.padded_len} tokens: the pads would "
                                                  f"count, and its rows are not the token rows)", node)
        analyzer.plan.pads_masked[node] = (summed, where, fill)
    analyzer.plan.sums_over_ranks.append(node)
    return REPLICATE


def _adds_rows_into_zeros(analyzer, node) -> bool:
    if not (is_method(node, "scatter_add_", "scatter_add") or is_function(node, torch.scatter_add)):
        return False
    dst = first_arg(node)
    return is_function(dst, torch.zeros, torch.zeros_like) and not is_sharded(analyzer.place(dst)) and (
        len(dst.users) == 1 or not is_mutating(node))


@rule("sums_by_group", _adds_rows_into_zeros)
def sums_by_group(analyzer, node):
    """``zeros(n).scatter_add_(0, index, src)`` with an index per token (row): per-group sums over every token
    (HF's load-balancing counts under a padding mask): this rank's part, summed over the ranks.  A replicated
    ``src`` laid out as the rows (the flat mask) is sharded like them."""
    args = dict(zip(("self", "dim", "index", "src"), node.args), **node.kwargs)
    index, src, dim = args.get("index"), args.get("src"), args.get("dim")
    where = analyzer.place(index)
    if not isinstance(where, (Shard, MergedRows)) or val(index).dim() != 1 or norm_dim(dim, 1) != 0 \
            or not isinstance(src, fx.Node) or val(src).shape != val(index).shape:
        raise Refused(CODES.unsupported_op, f"`{op_name(node)}` into zeros with an index that is not one per token",
                      node)
    if not is_sharded(analyzer.place(src)):
        outer, inner = factors(where)
        analyzer.shard_input(node, src, 0 if isinstance(where, Shard) else (0, outer, inner))
    elif analyzer.place(src) != where:
        raise Refused(CODES.misaligned_operands, f"`{op_name(node)}` with values placed unlike its index", node)
    return sum_over_ranks(analyzer, node, "per-group sums over the sequence",
                          summed=3 if len(node.args) > 3 else "src")


def histc_range(node) -> tuple:
    """``(min, max)`` of a ``torch.histc`` call (torch's defaults 0, 0: the data's own range); either may be a
    graph value, which the callers refuse."""
    kwargs = dict(zip(("bins", "min", "max"), node.args[1:4]), **node.kwargs)
    return kwargs.get("min", 0), kwargs.get("max", 0)


@rule("histc_of_rows", lambda analyzer, node: is_function(node, torch.histc))
def histc_of_rows(analyzer, node):
    """``histc`` of token values (a router's expert ids): this rank's counts, summed over the ranks.  A range
    taken from the data (``min == max``) would be each rank's own: refused."""
    lo, hi = histc_range(node)
    if not isinstance(lo, (int, float)) or not isinstance(hi, (int, float)) or not lo < hi:
        raise Refused(CODES.reduces_sequence, f"`histc` of token values over the data's own range [{lo}, {hi}]",
                      node)
    return sum_over_ranks(analyzer, node, "counts over the sequence", fill=lo - 1)  # histc ignores values below


# -- matmul ------------------------------------------------------------------------------------------
@rule("matmul", on_functions(operator.matmul, torch.matmul, torch.bmm))
def matmul(analyzer, node):
    """Sequence in a batch or row dim passes through; a replicated batch operand with the full S on the
    aligned batch dim is sharded there; contracting over the sequence (attention scores) refuses."""
    a, b = node.args[:2]
    va, vb, v = val(a), val(b), val(node)
    pa, pb = analyzer.place(a), analyzer.place(b)
    n = v.dim()
    if is_sharded(pa) and pa.dim == va.dim() - 1:
        raise Refused(CODES.contracts_sequence, "matmul contracts over the sequence dim (attention not recognized?)",
                      node)
    if is_sharded(pb) and vb.dim() >= 2 and pb.dim == vb.dim() - 2:
        raise Refused(CODES.contracts_sequence, "matmul contracts over the sequence dim (attention not recognized?)",
                      node)
    if is_sharded(pa) and is_sharded(pb):
        out_a = n - va.dim() + pa.dim
        out_b = n - vb.dim() + pb.dim
        if out_a != out_b or pa.dim >= va.dim() - 2 or at_dim(pa, out_a) != at_dim(pb, out_b):
            raise Refused(CODES.contracts_sequence,
                          "matmul of two sharded values along different dims (attention scores?)", node)
        return at_dim(pa, out_a)
    if is_sharded(pa):
        out = n - va.dim() + pa.dim
        if pa.dim < va.dim() - 2 and vb.dim() > 2:
            aligned = out - (n - vb.dim())
            if 0 <= aligned < vb.dim() - 2 and vb.shape[aligned] != 1:
                if vb.shape[aligned] != analyzer.S or not isinstance(pa, Shard):
                    raise Refused(CODES.misaligned_operands, f"replicated `{b.name}` does not line up with the "
                                                             "sequence in a batched matmul", node)
                analyzer.shard_input(node, b, aligned)
        return at_dim(pa, out)
    out = n - 1 if pb.dim == vb.dim() - 1 else n - vb.dim() + pb.dim
    if pb.dim < vb.dim() - 2 and va.dim() > 2:
        aligned = out - (n - va.dim())
        if 0 <= aligned < va.dim() - 2 and va.shape[aligned] != 1:
            if va.shape[aligned] != analyzer.S or not isinstance(pb, Shard):
                raise Refused(CODES.misaligned_operands, f"replicated `{a.name}` does not line up with the "
                                                         "sequence in a batched matmul", node)
            analyzer.shard_input(node, a, aligned)
    return at_dim(pb, out)


# -- dim moves: transpose, permute, t, unsqueeze -----------------------------------------------------
@rule("transpose", on_ops((torch.transpose,), ("transpose",)))
def transpose(analyzer, node):
    x = first_arg(node)
    d = analyzer.place(x).dim
    a, b = (norm_dim(i, val(x).dim()) for i in node.args[1:3])
    return at_dim(analyzer.place(x), b if d == a else a if d == b else d)


@rule("permute", on_ops((torch.permute,), ("permute",)))
def permute(analyzer, node):
    x, args = first_arg(node), node.args
    dims = args[1] if len(args) == 2 and isinstance(args[1], (list, tuple)) else args[1:]
    return at_dim(analyzer.place(x), [norm_dim(i, val(x).dim()) for i in dims].index(analyzer.place(x).dim))


@rule("t", on_methods("t"))
def matrix_t(analyzer, node):
    placement = analyzer.place(first_arg(node))
    return at_dim(placement, 1 - placement.dim)


@rule("unsqueeze", on_ops((torch.unsqueeze,), ("unsqueeze",)))
def unsqueeze(analyzer, node):
    placement = analyzer.place(first_arg(node))
    k = norm_dim(node.args[1], val(node).dim())
    return at_dim(placement, placement.dim + 1 if k <= placement.dim else placement.dim)


# -- reshapes ----------------------------------------------------------------------------------------
def reshape_dim(analyzer, node, x, out_val) -> Shard | MergedRows | Permuted:
    """Where the rows of ``x`` land in a reshape to ``out_val``'s shape.  In the flat (row-major) order a token
    is a block of ``after`` elements (its slots and the trailing dims) repeated S times; the output dim whose
    flat stride divides ``after`` and whose span covers the S blocks holds the sequence whole: the elements of
    that dim before the sequence are merged batch rows (``outer``), the ones after it slots (``inner``).
    Permuted rows (a rank-local order) may only move, never merge with other dims."""
    placement = analyzer.place(x)
    base = placement.rows if isinstance(placement, Permuted) else placement
    outer, inner = factors(base)
    in_shape, out_shape = list(val(x).shape), list(out_val.shape)
    after = inner * prod(in_shape[base.dim + 1:])
    before = prod(in_shape[:base.dim]) * outer
    candidates = []
    for j, n in enumerate(out_shape):
        stride = prod(out_shape[j + 1:])
        if after % stride or (stride * n) % (after * analyzer.S):
            continue
        new_outer, new_inner = stride * n // (after * analyzer.S), after // stride
        # implied when S > 1; with S = 1 it picks the dims that really hold the rows among size-1 ones
        if prod(out_shape[:j]) * new_outer == before:
            candidates.append((j, new_outer, new_inner))
    # S = 1 leaves several: the one that keeps the factors
    candidates.sort(key=lambda c: (c[1], c[2]) != (outer, inner))
    if candidates:
        j, new_outer, new_inner = candidates[0]
        if not isinstance(placement, Permuted):
            return rows(j, new_outer, new_inner)
        if (new_outer, new_inner) == (outer, inner) and out_shape[j] == val(x).shape[base.dim]:
            return Permuted(rows(j, outer, inner), placement.by)
    raise Refused(CODES.reshapes_sequence,
                  f"`{op_name(node)}` merges or splits the sequence dim ({in_shape} -> {out_shape})", node)


@rule("squeeze", on_ops((torch.squeeze,), ("squeeze",)))
def squeeze(analyzer, node):
    return reshape_dim(analyzer, node, first_arg(node), val(node))


@rule("dtype_view", lambda analyzer, node: is_method(node, "view")
      and any(isinstance(a, torch.dtype) for a in node.args[1:]))
def dtype_view(analyzer, node):
    x = first_arg(node)
    if val(node).shape != val(x).shape:
        raise Refused(CODES.reshapes_sequence, "dtype view that changes the shape of a sharded value", node)
    return analyzer.place(x)


def refuse_dynamic_reshape(node):
    if any(isinstance(a, fx.Node) for a in node.args[1:]):
        raise Refused(CODES.reshapes_sequence, "dynamic reshape of a sharded value", node)


@rule("reshape", on_ops((torch.reshape, torch.flatten), ("view", "reshape", "flatten", "unflatten")))
def reshape(analyzer, node):
    """Keeps the sequence dim whole, merges batch dims or slots into it, or splits them out of merged rows;
    shape constants become local ones."""
    x, v = first_arg(node), val(node)
    refuse_dynamic_reshape(node)
    out = reshape_dim(analyzer, node, x, v)
    if is_method(node, "view", "reshape") or is_function(node, torch.reshape):
        analyzer.plan.new_args[node] = ((x, tuple(analyzer.local_shape(v, out))), {})
    return out


# -- GPT-2's Conv1D: addmm(bias, x_2d, weight) --------------------------------------------------------
@rule("addmm", on_functions(torch.addmm))
def addmm(analyzer, node):
    bias, rows, weight = node.args[:3]
    if analyzer.place(rows) != Shard(0) or is_sharded(analyzer.place(weight)) or is_sharded(analyzer.place(bias)):
        raise Refused(CODES.unsupported_op, "addmm with the sequence outside the rows of its first matrix", node)
    return Shard(0)


# -- repeats and broadcasts --------------------------------------------------------------------------
@rule("repeat_interleave", on_ops((torch.repeat_interleave,), ("repeat_interleave",)))
def repeat_interleave(analyzer, node):
    args, x = node.args, first_arg(node)
    placement = analyzer.place(x)
    dim = node.kwargs.get("dim", args[2] if len(args) > 2 else None)
    repeats = node.kwargs.get("repeats", args[1] if len(args) > 1 else None)
    if dim is None or isinstance(repeats, fx.Node):
        raise Refused(CODES.mixes_positions, "repeat_interleave flattening the sequence, or by tensor counts", node)
    if norm_dim(dim, val(x).dim()) != placement.dim:
        return placement
    if not isinstance(repeats, int) or isinstance(placement, Permuted):
        raise Refused(CODES.mixes_positions, "repeat_interleave along the sequence dim", node)
    # each row (token, or token slot) repeated in place: k more slots per token (a mixture of experts' dispatch)
    outer, inner = factors(placement)
    return rows(placement.dim, outer, inner * repeats)


@rule("broadcast_to", on_ops((torch.broadcast_to,), ("broadcast_to",)))
def broadcast_to(analyzer, node):
    x, v = first_arg(node), val(node)
    out = analyzer.place(x).shifted(v.dim() - val(x).dim())
    analyzer.plan.new_args[node] = ((x, tuple(analyzer.local_shape(v, out))), {})
    return out


@rule("expand_repeat", on_methods("expand", "repeat"))
def expand_or_repeat(analyzer, node):
    x, v, args = first_arg(node), val(node), node.args
    out = analyzer.place(x).shifted(v.dim() - val(x).dim())
    if is_method(node, "repeat"):
        reps = args[1] if len(args) == 2 and isinstance(args[1], (list, tuple)) else args[1:]
        if reps[out.dim] != 1:
            if isinstance(out, Permuted):
                raise Refused(CODES.mixes_positions, "repeat along rows permuted by a sort", node)
            # the whole block of rows again, tokens still in (batch, token, slot) order inside: more batch rows
            outer, inner = factors(out)
            return rows(out.dim, outer * reps[out.dim], inner)
    else:
        analyzer.plan.new_args[node] = ((x, tuple(analyzer.local_shape(v, out))), {})
    return out


@rule("complex_view", on_functions(torch.view_as_complex, torch.view_as_real))
def complex_view(analyzer, node):
    return analyzer.place(first_arg(node))  # the (re, im) pair is a trailing dim, never the sequence


# -- split and cat -----------------------------------------------------------------------------------
@rule("split", on_ops((torch.split, torch.chunk, torch.unbind), ("split", "chunk", "unbind", "tensor_split")))
def split(analyzer, node):
    args, kwargs, x = node.args, node.kwargs, first_arg(node)
    d = analyzer.place(x).dim
    unbind = is_method(node, "unbind") or is_function(node, torch.unbind)
    dim = kwargs.get("dim", args[2] if len(args) > 2 else 0)
    if unbind:
        dim = kwargs.get("dim", args[1] if len(args) > 1 else 0)
    dim = norm_dim(dim, val(x).dim())
    if dim == d:
        raise Refused(CODES.slices_sequence, f"`{op_name(node)}` along the sequence dim", node)
    out = at_dim(analyzer.place(x), d - 1 if unbind and dim < d else d)
    return TuplePlacement((out,) * len(val(node)))


def _joined(node):
    """``torch.cat`` / ``stack`` -> (its non-empty operands, the output dim they are joined along)."""
    dim = node.kwargs.get("dim", node.args[1] if len(node.args) > 1 else 0)
    return [t for t in node.args[0] if val(t).numel() > 0], norm_dim(dim, val(node).dim())


def _rows_after_join(node, rows_dim: int) -> int:
    """Where operand rows at ``rows_dim`` are in a cat (unchanged) or a stack (one later, at or after its dim)."""
    _, out_dim = _joined(node)
    return rows_dim + (1 if node.target is torch.stack and out_dim <= rows_dim else 0)


@rule("cat", on_functions(torch.cat, torch.concat, torch.concatenate, torch.stack))
def cat(analyzer, node):
    """Along another dim: replicated parts with the full S are sharded alike; along the sequence: refused."""
    nonempty, out_dim = _joined(node)
    placements = {analyzer.place(t) for t in nonempty} - {REPLICATE}
    if len(placements) != 1:
        raise Refused(CODES.misaligned_operands, "cat of values sharded along different dims", node)
    d = placements.pop().dim
    if node.target is not torch.stack and out_dim == d:
        if len(nonempty) == 1:
            return Shard(d)  # cat with empty tensors only (HF's cache init): pass-through
        raise Refused(CODES.cat_sequence, "cat along the sequence dim", node)
    out = Shard(_rows_after_join(node, d))
    for t in nonempty:
        if not is_sharded(analyzer.place(t)):
            if val(t).shape[d] == analyzer.S:
                analyzer.shard_input(node, t, d)
            else:
                raise Refused(CODES.misaligned_operands, f"replicated `{t.name}` in a cat with sharded values", node)
    return out


# -- merged (batch, sequence) rows ---------------------------------------------------------------------
@rule("merged_addmm", on_functions(torch.addmm))
def addmm_merged(analyzer, node):
    bias, rows, weight = node.args[:3]
    placement = analyzer.place(rows)
    if not isinstance(placement, MergedRows) or placement.dim != 0 or is_sharded(analyzer.place(bias)) \
            or is_sharded(analyzer.place(weight)):
        raise Refused(CODES.merged_rows, "addmm with merged batch and sequence rows outside its first matrix's rows",
                      node)
    return placement


@rule("cat_merged", on_functions(torch.cat, torch.concat, torch.concatenate, torch.stack))
def cat_merged(analyzer, node):
    """Values on the same merged rows joined along another dim (Phi-MoE's sparsemixer: each token's expert ids
    and weights, ``[B * S, 1]`` each, concatenated to ``[B * S, k]`` at batch > 1): the same rows placement."""
    nonempty, out_dim = _joined(node)
    placements = {analyzer.place(t) for t in nonempty}
    if len(placements) != 1 or not isinstance(next(iter(placements)), MergedRows):
        raise Refused(CODES.merged_rows, f"`{op_name(node)}` of values not all on the same merged batch and "
                                         "sequence rows", node)
    placement = placements.pop()
    if node.target is not torch.stack and out_dim == placement.dim:
        raise Refused(CODES.cat_sequence, f"`{op_name(node)}` along merged batch and sequence rows", node)
    return placement.shifted(_rows_after_join(node, placement.dim) - placement.dim)


@rule("merged_later_operand", lambda analyzer, node: not isinstance(analyzer.place(first_arg(node)), MergedRows))
def refuse_merged_later_operand(analyzer, node):
    raise Refused(CODES.merged_rows, f"`{op_name(node)}` with merged batch and sequence rows in a later operand",
                  node)


# -- the tables, in the order the analyzer tries them -------------------------------------------------
REPLICATED_RULES: tuple[Rule, ...] = (side_effect_free, embedding, positions_to_float)
SHARDED_RULES: tuple[Rule, ...] = (
    side_effect_free, sums_by_group, refuse_inplace_write, fused_loss, cross_entropy, attention, embedding,
    tuple_item, refuse_tuple_operand, gather_rows, indexing, topk_sort, pointwise_op, pointwise_autograd_function,
    like_constructor, new_constructor, one_hot, gather_scatter, min_max, dropout, linear, norm, softmax, reduction,
    histc_of_rows, matmul, transpose, permute, matrix_t, unsqueeze, squeeze, dtype_view, reshape, addmm,
    repeat_interleave, broadcast_to, expand_or_repeat, complex_view, split, cat, pointwise_inplace,
)
MERGED_RULES: tuple[Rule, ...] = (
    side_effect_free, sums_by_group, refuse_inplace_write, cross_entropy, addmm_merged, tuple_item,
    refuse_tuple_operand, gather_rows, cat_merged, refuse_merged_later_operand, topk_sort, pointwise_op, pointwise_autograd_function,
    like_constructor, one_hot, gather_scatter, min_max, dropout, linear, norm, softmax, reduction, histc_of_rows,
    matmul, transpose, permute, matrix_t, unsqueeze, squeeze, dtype_view, reshape, repeat_interleave, broadcast_to,
    expand_or_repeat, split, pointwise_inplace,
)
