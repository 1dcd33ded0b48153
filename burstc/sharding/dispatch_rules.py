"""Rules for token rows reordered on each rank: a mixture of experts' dispatch.

HF's MoE blocks (``grouped_mm`` experts, the default under ``torch.compile``) sort the token slots by expert id,
gather the tokens in that order, count them per expert (``histc``), run one grouped matmul whose groups are those
counts' running sums, and put the rows back with the inverse permutation.  No single op of that is position-wise,
but the region is: each token's output depends on its own hidden state and expert ids alone.  On a rank the same
ops run on its own tokens: the sort, the counts and the groups are its own, and they stay consistent with one
another, which is what the rules below check:

- a sort's values and indices are :class:`Permuted` / :class:`RowIndex` of that sort (``rules.topk_sort``);
- ``histc`` of an ascending sort's keys, keys that are top-k indices (never below the histogram's range), is
  that sort's :class:`GroupSizes`; ``cumsum`` of it, the offsets;
- a grouped matmul takes rows permuted by a sort with that same sort's offsets: row ``r`` meets the weight of
  its own key's group, whichever rows the rank holds;
- row numbers (:class:`RowIndex`) only index the values they number, are divided only by the slots per token,
  and invert only as a whole permutation (``inv[perm] = arange(n)``, ``argsort(perm)``);
- anything else that meets such a value is refused (``shard.unsupported_op``), so the region can't leak a rank's
  local order or counts into anything position-wise.

Dropless routing only: a capacity limit or expert-choice routing ranks tokens against each other, which shows
up here as an op outside these rules (a cumsum over rows, a topk along them) and refuses.
"""
from __future__ import annotations

import operator

import torch
import torch.fx as fx

from burstc.passes.graph_utils import is_function, is_method, is_mutating, op_name, val
from burstc.refusals import Refused
from burstc.sharding import rules as R
from burstc.sharding.codes import CODES
from burstc.sharding.placements import REPLICATE, GroupSizes, MergedRows, Permuted, RowIndex, Shard, factors, \
    is_sharded, rows

# the grouped matmuls a dispatch may call, by qualified op name: ``(input, weights, offs)``
GROUPED_MM_OPS = {"transformers::grouped_mm_fallback", "aten::_grouped_mm"}
# ops that only convert a value's dtype or layout: a sort's keys stay its keys through them
_KEY_CONVERSIONS = {"float", "int", "long", "to", "type", "double", "contiguous"}


def _qualified_name(node: fx.Node) -> str | None:
    target = node.target
    name = getattr(target, "_qualified_op_name", None) or getattr(getattr(target, "_schema", None), "name", None)
    return str(name) if name else None


def is_grouped_mm(analyzer, node) -> bool:
    return node.op == "call_function" and (_qualified_name(node) in GROUPED_MM_OPS or node.target in (
        getattr(torch.nn.functional, "grouped_mm", None), getattr(torch, "_grouped_mm", None)))


def _through_conversions(node):
    while isinstance(node, fx.Node) and node.op == "call_method" and node.target in _KEY_CONVERSIONS:
        node = node.args[0]
    return node


def _indices_output(node) -> bool:
    """``node`` (through reshapes, conversions and concatenations) is the indices a ``topk``/``sort``/``argmax``/
    ``max(dim)`` returned: non-negative integers."""
    while isinstance(node, fx.Node):
        if node.op == "call_method" and node.target in _KEY_CONVERSIONS | {"reshape", "view", "flatten"}:
            node = node.args[0]
        elif is_function(node, torch.reshape, torch.flatten):
            node = node.args[0]
        elif is_function(node, operator.getitem) and node.args[1] == 1 and isinstance(node.args[0], fx.Node) and (
                R.on_ops((torch.topk, torch.sort, torch.max, torch.min), ("topk", "sort", "max", "min"))(
                    None, node.args[0])):
            return True  # (values, indices) of topk / sort / max(dim) / min(dim)
        elif is_function(node, torch.cat, torch.concat, torch.stack) and node.args[0]:
            return all(_indices_output(part) for part in node.args[0])  # several routers' picks side by side
        else:
            return R.on_ops((torch.argmax, torch.argsort), ("argmax", "argsort"))(None, node)
    return False


def _sort_keys(analyzer, node) -> fx.Node | None:
    """The ascending sort whose sorted values ``node`` is (through dtype conversions), else None."""
    source = _through_conversions(node)
    if not (is_function(source, operator.getitem) and source.args[1] == 0):
        return None
    sort = source.args[0]
    if not R.on_ops((torch.sort,), ("sort",))(None, sort):
        return None
    descending = sort.kwargs.get("descending", sort.args[2] if len(sort.args) > 2 else False)
    return sort if descending is False else None


# -- row numbers -------------------------------------------------------------------------------------
def _is_permutation(index: RowIndex) -> bool:
    """A sort's indices (order = target permuted) or their inverse (target = order permuted)."""
    return (isinstance(index.order, Permuted) and index.order.rows == index.target) or (
        isinstance(index.target, Permuted) and index.target.rows == index.order)


def _local_extent(analyzer, placement) -> int:
    base = placement.rows if isinstance(placement, Permuted) else placement
    outer, inner = factors(base)
    return outer * analyzer.s * inner


@R.rule("row_numbers_per_token", lambda analyzer, node: is_function(node, operator.floordiv)
        and isinstance(analyzer.place(node.args[0]), RowIndex))
def slots_to_tokens(analyzer, node):
    """``perm // k``: row numbers of token slots (k per token) become the numbers of their tokens."""
    index, k = node.args[:2]
    by = analyzer.place(index)
    target = by.target
    if not isinstance(k, int) or k < 1 or not isinstance(target, (Shard, MergedRows)) or factors(target)[1] % k:
        raise Refused(CODES.unsupported_op, f"`{op_name(node)}` of row numbers by other than the slots per token",
                      node)
    outer, inner = factors(target)
    return RowIndex(target=rows(target.dim, outer, inner // k), order=by.order)


@R.rule("inverse_permutation", lambda analyzer, node: R.on_ops((torch.argsort,), ("argsort",))(analyzer, node)
        and isinstance(analyzer.place(R.first_arg(node)), RowIndex))
def argsort_of_permutation(analyzer, node):
    by = analyzer.place(R.first_arg(node))
    if not _is_permutation(by):
        raise Refused(CODES.unsupported_op, "argsort of row numbers that are not a permutation", node)
    return RowIndex(target=by.order, order=by.target)


def _writes_a_permutation(analyzer, node) -> bool:
    return (is_function(node, operator.setitem) or is_method(node, "__setitem__")) \
        and isinstance(node.args[1], fx.Node) and isinstance(analyzer.place(node.args[1]), RowIndex)


@R.rule("scatter_by_permutation", _writes_a_permutation)
def scatter_by_permutation(analyzer, node):
    """``dst[perm] = src`` over every row: ``src`` put back in ``perm``'s target order; with ``src =
    arange(n)``, ``dst`` becomes the inverse permutation (HF's ``inv_perm[perm] = arange(perm.size(0))``)."""
    dst, index, src = node.args[:3]
    by = analyzer.place(index)
    graph_order = {n: i for i, n in enumerate(analyzer.gm.graph.nodes)}
    if not _is_permutation(by) or val(dst).dim() != 1 or val(dst).shape != val(index).shape:
        raise Refused(CODES.unsupported_op, "a write through row numbers that does not cover every row once", node)
    if not is_sharded(analyzer.place(dst)):
        # e.g. torch.empty(n): the whole sequence's extent on every rank, which this rank's numbers cover in part
        raise Refused(CODES.unsupported_op, f"`{dst.name}` written through this rank's row numbers is not shaped "
                                            "like this rank's rows", node)
    if any(u is not node and graph_order[u] < graph_order[node] for u in dst.users):
        raise Refused(CODES.inplace_write, f"`{dst.name}` is read before the permutation is written into it", node)
    if is_function(src, torch.arange) and not is_sharded(analyzer.place(src)) and len(src.users) == 1 \
            and val(src).shape == val(index).shape and not src.kwargs.get("dtype", torch.int64).is_floating_point \
            and len(src.args) == 1 and isinstance(src.args[0], int):
        analyzer.plan.new_args[src] = ((_local_extent(analyzer, by.order),), dict(src.kwargs))
        analyzer.plan.placement[dst] = RowIndex(target=by.order, order=by.target)
    elif analyzer.place(src) == by.order:
        analyzer.plan.placement[dst] = by.target
    else:
        raise Refused(CODES.unsupported_op, f"`{src.name}` written through row numbers is neither `arange` nor laid "
                                            "out as they are", node)
    return REPLICATE


# -- group sizes -------------------------------------------------------------------------------------
@R.rule("group_sizes", lambda analyzer, node: is_function(node, torch.histc))
def group_sizes(analyzer, node):
    """``histc(sorted_keys, bins, min, max)``: this rank's count per group of an ascending sort's keys.  The
    keys must be top-k/sort indices (non-negative) and ``min <= 0 < max`` fixed (``min == max`` would take the
    range from the data): every key then lands in the group its value says, whichever rank holds it."""
    keys = R.first_arg(node)
    lo, hi = R.histc_range(node)
    sort = _sort_keys(analyzer, keys)
    placement = analyzer.place(keys)
    if sort is None or not isinstance(placement, Permuted) or placement.by != sort.name:
        raise Refused(CODES.unsupported_op, f"`histc` of `{keys.name}`, not the keys of an ascending sort of token "
                                            "rows", node)
    if not _indices_output(R.first_arg(sort)):
        raise Refused(CODES.unsupported_op, "`histc` of sort keys that are not top-k indices (they could fall "
                                            "below the histogram's range)", node)
    if not isinstance(lo, (int, float)) or not isinstance(hi, (int, float)) or not lo <= 0 < hi:
        raise Refused(CODES.unsupported_op, f"`histc` range [{lo}, {hi}] (needs min <= 0 < max, fixed)", node)
    return GroupSizes(placement.by, cumulative=False)


@R.rule("group_offsets", lambda analyzer, node: R.on_ops((torch.cumsum,), ("cumsum",))(analyzer, node)
        and isinstance(analyzer.place(R.first_arg(node)), GroupSizes))
def group_offsets(analyzer, node):
    sizes = analyzer.place(R.first_arg(node))
    dim = node.kwargs.get("dim", node.args[1] if len(node.args) > 1 else None)
    if sizes.cumulative or dim not in (0, -1) or val(node).dim() != 1:
        raise Refused(CODES.unsupported_op, "a running sum of group sizes other than their offsets", node)
    return GroupSizes(sizes.by, cumulative=True)


@R.rule("grouped_mm", is_grouped_mm)
def grouped_mm(analyzer, node):
    """``grouped_mm(rows, weights, offs)``: rows permuted by a sort, offsets of that same sort's keys:
    each row meets its own group's weights."""
    x, weights = node.args[:2]
    offs = node.kwargs.get("offs", node.args[2] if len(node.args) > 2 else None)
    rows_at, offsets = analyzer.place(x), analyzer.place(offs)
    if not isinstance(rows_at, Permuted) or rows_at.dim != 0 or val(x).dim() != 2:
        raise Refused(CODES.unsupported_op, f"`{op_name(node)}` on `{x.name}` ({rows_at}), not 2-D rows of a sort",
                      node)
    if offsets != GroupSizes(rows_at.by, cumulative=True):
        raise Refused(CODES.unsupported_op, f"`{op_name(node)}` with offsets ({offsets}) that are not the running "
                                            f"sums of `{rows_at.by}`'s group sizes", node)
    others = [a for a in node.all_input_nodes if a is not x and a is not offs]
    if any(is_sharded(analyzer.place(a)) for a in others):
        raise Refused(CODES.unsupported_op, f"`{op_name(node)}` with sharded weights", node)
    return rows_at


@R.rule("row_numbers_elsewhere", lambda analyzer, node: any(
    isinstance(analyzer.place(a), (RowIndex, GroupSizes)) for a in analyzer.tensor_args(node)))
def refuse_row_numbers(analyzer, node):
    """Row numbers and group sizes are this rank's own: any other use would treat them as one device's."""
    kinds = sorted({type(analyzer.place(a)).__name__ for a in analyzer.tensor_args(node)
                    if isinstance(analyzer.place(a), (RowIndex, GroupSizes))})
    raise Refused(CODES.unsupported_op, f"`{op_name(node)}` on this rank's own {' and '.join(kinds)} (only "
                                        "gathers, inverses and grouped matmuls may use them)", node)


@R.rule("permuted_inplace", lambda analyzer, node: is_mutating(node)
        and not R.pointwise_inplace.matches(analyzer, node))
def refuse_permuted_inplace(analyzer, node):
    """Elementwise in-place ops (a bias added with ``add_``) pass (``R.pointwise_inplace``); no other write."""
    raise Refused(CODES.inplace_write, f"in-place `{op_name(node)}` on rows permuted by a sort", node)


# The table the analyzer uses when an input is Permuted, RowIndex or GroupSizes.
DISPATCH_RULES: tuple[R.Rule, ...] = (
    R.side_effect_free, scatter_by_permutation, slots_to_tokens, argsort_of_permutation, R.gather_rows, R.indexing,
    group_sizes, group_offsets, grouped_mm, R.like_constructor, refuse_row_numbers, refuse_permuted_inplace,
    R.tuple_item, R.refuse_tuple_operand, R.pointwise_op, R.pointwise_inplace, R.dropout, R.linear, R.norm,
    R.softmax, R.reduction, R.matmul, R.transpose, R.permute, R.matrix_t, R.unsqueeze, R.squeeze, R.dtype_view,
    R.reshape, R.split, R.topk_sort, R.min_max,
)
