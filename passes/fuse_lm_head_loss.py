"""Fuse the LM head and the cross-entropy loss so the [tokens, vocab] logits are never materialized.

Before (HF transformers 5.x ``LlamaForCausalLM`` with labels; nanoGPT and torchtitan are variants)::

    logits  = linear(hidden_BSH, lm_head_weight)          # [B, S, V]  <- also a graph output
    logits2 = logits.float().view(-1, V)                  # optional upcast / reshapes / slicing
    loss    = cross_entropy(logits2, labels_N, ignore_index=-100, reduction="mean")

After::

    loss = burstc.ops.linear_cross_entropy(hidden_BSH, lm_head_weight, labels_N, ...)

The loss may also be written ``nll_loss(log_softmax(logits, dim=-1), labels)`` (what ``cross_entropy``
computes, and how older code spells it); reshapes that keep the vocab dim last and upcasts may stand
between the two.  The log-probabilities must have no other use.  CE's sequence layout, the logits
transposed to ``[B, V, S]`` with ``[B, S]`` targets, is the same loss and is fused too.

What may stand between the linear and the loss: ``float``/``to(float32)`` upcasts, ``contiguous``,
reshapes that keep the vocab dim last (they only regroup tokens, so token order is preserved),
token slicing (``logits[..., :-1, :]``: for a mean or a sum, the whole sequence with ``ignore_index`` targets where
the slice cut, which the shard pass can split; else the slice applied to the hidden states), a constant scale of
the linear's output (Cohere's ``logits * s``; Granite's ``logits / d`` when 1 / d is exact, a power of
two, so that it is the same product) and a tanh soft-cap (``c * tanh(x / c)``).  Anything else, a loss option the fused op can't reproduce exactly (class
weights, legacy ``size_average``/``reduce``), or a class dim other than the vocab: the candidate is
skipped with its reason.

Logits that are only returned as a graph output (raw, or as scaled, soft-capped or upcast on their way to
the loss: Gemma-2, Cohere and Granite return those) are dropped (``burstc.guards.DROPPED_LOGITS``, a stand-in
whose every use raises an error that explains ``keep_logits``, is returned in their place) in a
graph compiled for training, kept in one compiled under no_grad (evaluation), or as ``keep_logits``
says; logits that anything else uses are kept, and the report says so.

Longer than ~400 lines because the matcher is one walk (loss -> log_softmax/transposes -> upcasts, reshapes,
slices, scale, soft-cap -> linear) whose every step either passes a value through exactly or refuses with
a code: splitting the walk from its refusals would scatter one chain of reasoning over two files.
"""
from __future__ import annotations

import math
import operator
from dataclasses import dataclass, field

import torch
import torch.fx as fx
import torch.nn.functional as F

from burstc.ops.linear_cross_entropy import linear_cross_entropy
from burstc.passes import module_path
from burstc.passes.graph_utils import const_number as _const
from burstc.passes.graph_utils import dtype_name, eliminate_dead_code
from burstc.passes.graph_utils import in_place_writes as _in_place_writes
from burstc.passes.graph_utils import normalized_kwargs as _normalized_kwargs
from burstc.passes.graph_utils import fake_mode_of as _fake_mode
from burstc.passes.graph_utils import is_function as _is_function
from burstc.passes.graph_utils import is_method as _is_method
from burstc.passes.graph_utils import set_meta as _set_meta
from burstc.passes.graph_utils import shape_args
from burstc.passes.graph_utils import val as _val
from burstc.refusals import register_codes

KIND = "lm_head_loss"
_CROSS_ENTROPY_TARGETS = (F.cross_entropy,)
_NLL_TARGETS = (F.nll_loss,)
_LOG_SOFTMAX_TARGETS = (F.log_softmax, torch.log_softmax)
_LINEAR_TARGETS = (torch._C._nn.linear, F.linear)
_RESHAPE_METHODS = ("view", "reshape", "flatten")
_RESHAPE_FUNCTIONS = (torch.reshape, torch.flatten)


CODES = register_codes("lm_head_loss", {
    "softcap": "the logits' soft-cap is not one positive constant tanh cap",
    "logit_scale": "the logits are scaled in a way the fused loss can't reproduce exactly",
    "no_shape_info": "a node on the loss chain has no shape information",
    "device_or_dtype": "the logits move to another device or dtype before the loss",
    "vocab_reshape": "a reshape between the LM head and the loss changes the vocab dim",
    "logits_source": "the logits are not computed by a linear in this graph",
    "token_indexing": "the logits are indexed in a way the fused loss can't follow",
    "unsupported_op": "an op between the LM head and the loss that the fusion does not understand",
    "in_place_write": "the logits or the LM head's inputs are modified in place before the loss",
    "log_softmax": "nll_loss whose input is not a plain log_softmax of the logits",
    "loss_arguments": "loss arguments the fused loss does not reproduce (class weights, reductions, ...)",
    "targets": "targets that are not int64 class indices",
    "loss_shape": "loss input/target shapes the fused loss does not take",
    "lm_head_weight": "the LM head weight is not a 2-D floating-point tensor",
    "match_failed": "the matcher raised an unexpected error (a bug: please report it)",
})


class _Refuse(Exception):
    """A candidate the pass won't rewrite: a registered code and the report's reason."""

    def __init__(self, code: str, reason: str):
        super().__init__(reason)
        self.code = code


@dataclass
class LMHeadLossMatch:
    loss_node: fx.Node
    linear_node: fx.Node
    hidden: fx.Node
    weight: fx.Node
    bias: fx.Node | None
    target: fx.Node
    ignore_index: int
    reduction: str
    label_smoothing: float
    softcap: float | None
    logit_scale: float | None    # logits * s
    logit_divisor: float | None  # logits / d (rounds differently from * (1 / d))
    token_slices: list = field(default_factory=list)  # getitem indices applied to the logits
    chain: list = field(default_factory=list)         # nodes from the CE input back to the linear


def _full_slice(item) -> bool:
    return isinstance(item, slice) and item == slice(None, None, None)


def _token_slice_ok(index, ndim: int) -> bool:
    """True if ``x[index]`` selects along leading (token) dims only and leaves the last dim whole."""
    items = index if isinstance(index, tuple) else (index,)
    if not all(isinstance(i, (slice, int)) or i is Ellipsis for i in items):
        return False
    if any(isinstance(i, int) for i in items):
        return False  # an int index drops a dim; keep the rule simple
    if Ellipsis in items:
        after = items[items.index(Ellipsis) + 1:]
        return not after or _full_slice(after[-1])
    return len(items) < ndim or _full_slice(items[-1])


def _slice_as_ignored_targets(match: LMHeadLossMatch, hidden_val) -> tuple[int, int, int] | None:
    """``(dim, before, after)`` when the logits' one token slice keeps a contiguous run of one token dim (HF 4.x's
    ``logits[..., :-1, :]`` next-token shift: dim 1, 0 before, 1 after) and the loss is a mean or a sum: then the
    same loss is the unsliced hidden states' with their targets padded by ``ignore_index`` where the slice cut
    (an ignored token adds nothing to the sum nor to the mean's count, label smoothing included), and the
    sequence stays whole for the shard pass, which can't split a slice of it.  None otherwise."""
    if match.reduction not in ("mean", "sum") or len(match.token_slices) != 1:
        return None
    shape = tuple(hidden_val.shape)
    if not all(isinstance(size, int) for size in shape):
        return None  # symbolic lengths: keep the slice
    index = match.token_slices[0]
    items = list(index) if isinstance(index, tuple) else [index]
    if Ellipsis in items:
        at = items.index(Ellipsis)
        items = items[:at] + [slice(None)] * (len(shape) - len(items) + 1) + items[at + 1:]
    items += [slice(None)] * (len(shape) - len(items))
    cut = [(dim, item) for dim, item in enumerate(items) if not _full_slice(item)]
    if len(cut) != 1 or not isinstance(cut[0][1], slice):
        return None
    dim, item = cut[0]
    start, stop, step = item.indices(shape[dim])
    if step != 1 or dim >= len(shape) - 1 or stop <= start:
        return None
    return dim, start, shape[dim] - stop


def _softcap_of(node: fx.Node):
    """``c * tanh(x / c)`` ending at ``node`` -> (c, x, [tanh, div] nodes), else None."""
    if not (_is_function(node, operator.mul) and len(node.args) == 2):
        return None
    tanh_node, cap = node.args
    if not isinstance(tanh_node, fx.Node):
        tanh_node, cap = cap, tanh_node
    if _const(cap) is None or not isinstance(tanh_node, fx.Node):
        return None
    if not (_is_function(tanh_node, torch.tanh) or _is_method(tanh_node, "tanh")):
        return None
    div_node = tanh_node.args[0]
    if not (isinstance(div_node, fx.Node) and _is_function(div_node, operator.truediv)
            and isinstance(div_node.args[0], fx.Node) and _const(div_node.args[1]) == cap):
        return None
    if _const(cap) == 0:
        raise _Refuse(CODES.softcap, "logits soft-capped with c = 0 (x / 0)")
    # c * tanh(x / c) is the same function for -c (tanh is odd): the op takes the positive cap
    return abs(float(cap)), div_node.args[0], [tanh_node, div_node]


def _logit_scale_of(node: fx.Node):
    """``x * s``, ``s * x`` or ``x / d`` with a constant s (d) -> (s, None, x) or (None, d, x), else None.  The
    op divides by d as the model does (``x / 3`` and ``x * (1 / 3)`` round differently)."""
    is_mul = _is_function(node, operator.mul, torch.mul) or _is_method(node, "mul")
    is_div = _is_function(node, operator.truediv, torch.div) or _is_method(node, "div")
    if not (is_mul or is_div) or len(node.args) != 2 or node.kwargs:
        return None
    tensor, factor = node.args
    if is_mul and not isinstance(tensor, fx.Node):
        tensor, factor = factor, tensor
    factor = _const(factor)
    if not isinstance(tensor, fx.Node) or factor is None or isinstance(factor, bool):
        return None
    factor = float(factor)
    if is_div:
        if factor == 0.0 or not math.isfinite(factor):
            raise _Refuse(CODES.logit_scale, f"logits divided by {factor:g}")
        return None, factor, tensor
    if not math.isfinite(factor):
        raise _Refuse(CODES.logit_scale, f"logits scaled by {factor:g}")
    return factor, None, tensor


def _vocab_preserving_source(node: fx.Node, what: str) -> fx.Node | None:
    """The input of ``node`` when it passes ``what`` (logits or log-probabilities) through with the vocab dim
    last and the values kept (``float``/``contiguous``, an fp32 upcast or a no-op ``to``/``type`` on the same
    device, a reshape that only regroups tokens); None for any other op.  A cast or reshape that would change
    what the loss sees is refused."""
    if not (_is_method(node, "float", "contiguous", "to", "type", *_RESHAPE_METHODS)
            or _is_function(node, *_RESHAPE_FUNCTIONS)):
        return None
    source = node.args[0]
    val, src_val = _val(node), _val(source)
    if val is None or src_val is None:
        raise _Refuse(CODES.no_shape_info, f"no shape information on `{node.name}`")
    if _is_method(node, "to", "type"):
        # judged from the values (``.to(other_tensor)`` carries its dtype in a tensor)
        if val.device != src_val.device:
            raise _Refuse(CODES.device_or_dtype, f"`{node.name}` moves the {what} to another device before the loss")
        if val.dtype not in (torch.float32, src_val.dtype):
            raise _Refuse(CODES.device_or_dtype, f"{what} are cast to {val.dtype} before the loss; the fused loss computes in float32")
    elif val.shape[-1] != src_val.shape[-1]:
        raise _Refuse(CODES.vocab_reshape, f"`{node.format_node()}` reshapes the vocab dim of the {what}")
    return source


def _walk_to_linear(ce_input: fx.Node, vocab_hint: int | None):
    """Follow the CE input back to the LM-head linear; returns (linear, chain, slices, softcap, (scale, divisor))."""
    chain, slices, softcap, logit_scaling = [], [], None, (None, None)
    node = ce_input
    while True:
        if not isinstance(node, fx.Node):
            raise _Refuse(CODES.logits_source, "cross_entropy input is not a graph value")
        if _is_function(node, *_LINEAR_TARGETS):
            return node, chain, slices, softcap, logit_scaling
        if node.op == "placeholder":
            raise _Refuse(CODES.logits_source, "the logits come from outside this graph (a graph break between the LM head and the loss)")
        val = _val(node)
        chain.append(node)
        source = _vocab_preserving_source(node, "logits")
        if source is not None:
            if slices and tuple(val.shape) != tuple(_val(source).shape):
                # the slice indexes the regrouped tokens: applied to the hidden states it would pick others
                raise _Refuse(CODES.token_indexing, f"the logits are sliced after `{node.name}` regroups their tokens")
            node = source
            continue
        if _is_function(node, operator.getitem):
            src_val = _val(node.args[0])
            if src_val is None or not _token_slice_ok(node.args[1], src_val.dim()):
                raise _Refuse(CODES.token_indexing, f"`{node.name}` indexes the logits in a way the fused loss can't follow")
            slices.append(node.args[1])
            node = node.args[0]
            continue
        capped = _softcap_of(node)
        if capped is not None:
            if softcap is not None:
                raise _Refuse(CODES.softcap, "two soft-caps on the logits")
            softcap, node, cap_nodes = capped
            chain.extend(cap_nodes)
            continue
        scaled = _logit_scale_of(node)
        if scaled is not None:
            *factors, source = scaled
            if not _is_function(source, *_LINEAR_TARGETS):
                # the op scales the linear's output in its dtype, before any upcast, reshape or soft-cap
                raise _Refuse(CODES.logit_scale, f"logits scaled by a constant at `{node.name}`, not directly on the lm_head output")
            logit_scaling, node = tuple(factors), source
            continue
        what = node.target if node.op == "call_method" else getattr(node.target, "__name__", node.target)
        raise _Refuse(CODES.unsupported_op, f"op `{what}` between the lm_head linear and cross_entropy is not supported")


def find_lm_head_losses(gm: fx.GraphModule, context) -> list[LMHeadLossMatch]:
    matches = []
    writes = position = None
    for node in gm.graph.nodes:
        if not _is_function(node, *_CROSS_ENTROPY_TARGETS, *_NLL_TARGETS):
            continue
        try:
            match = _match_one(node)
            if writes is None:
                writes = _in_place_writes(gm.graph)
                position = {n: i for i, n in enumerate(gm.graph.nodes)}
            _check_no_lost_writes(match, writes, position)
            matches.append(match)
        except _Refuse as refusal:
            context.skip(KIND, node, str(refusal), code=refusal.code)
        except Exception as error:  # noqa: BLE001 - matching only reads the graph: skipping is always safe
            context.skip(KIND, node, f"the fusion pass failed to match this loss ({type(error).__name__}: "
                                     f"{error}) - please report this", code=CODES.match_failed)
    return matches


def _check_no_lost_writes(match: LMHeadLossMatch, writes, position) -> None:
    """The fused op replaces the linear and reads hidden, weight and bias where the loss was, and the
    logits disappear: an in-place write to the logits before the loss, or to hidden/weight/bias between
    the linear and the loss, would be lost.  (The targets are read where the loss was, as before.)"""
    start, end = position[match.linear_node], position[match.loss_node]
    logits = {match.linear_node, *match.chain}
    operands = {n for n in (match.hidden, match.weight, match.bias) if isinstance(n, fx.Node)}
    for op, aliases in writes:
        if position[op] < end and aliases & logits:
            raise _Refuse(CODES.in_place_write, f"the logits are modified in place (`{op.name}`) before the loss")
        if start < position[op] < end and aliases & operands:
            raise _Refuse(CODES.in_place_write, f"an input of the LM head is modified in place (`{op.name}`) before the loss")


def _log_softmax_source(nll_input: fx.Node):
    """``nll_loss``'s input back to the ``log_softmax`` over the vocab dim: (logits, nodes in between, inclusive).

    Only ops that commute with a log-softmax over the last dim may follow it (``_vocab_preserving_source``),
    and each must have no other user: the fused op replaces them all."""
    between, node = [], nll_input
    while True:
        if not isinstance(node, fx.Node) or node.op == "placeholder":
            raise _Refuse(CODES.log_softmax, "nll_loss input is not a log_softmax computed in this graph")
        if len(node.users) != 1:
            raise _Refuse(CODES.log_softmax, f"the log-probabilities (`{node.name}`) have another use besides nll_loss")
        between.append(node)
        is_log_softmax = _is_function(node, *_LOG_SOFTMAX_TARGETS) or _is_method(node, "log_softmax")
        if is_log_softmax:
            kw = _normalized_kwargs(node) if node.op == "call_function" else None
            if kw is None:  # the method form (or an unnormalizable call): (input, dim, dtype)
                kw = dict(zip(("input", "dim", "dtype"), node.args), **node.kwargs)
            source, dim, dtype = kw.get("input"), kw.get("dim"), kw.get("dtype")
            source_val = _val(source)
            if source_val is None or not isinstance(dim, int) or dim not in (-1, source_val.dim() - 1):
                raise _Refuse(CODES.log_softmax, f"log_softmax at `{node.name}` is not over the last (vocab) dim")
            if dtype not in (None, torch.float32):
                raise _Refuse(CODES.log_softmax, f"log_softmax at `{node.name}` computes in {dtype}; the fused loss computes in float32")
            return source, between
        source = _vocab_preserving_source(node, "log-probabilities")
        if source is not None:
            node = source
            continue
        raise _Refuse(CODES.log_softmax, f"nll_loss input is not a log_softmax of the logits (it comes from `{node.name}`)")


def _untransposed_logits(ce_input: fx.Node) -> fx.Node | None:
    """``x`` when ``ce_input`` is ``x.transpose(1, 2)`` / ``x.permute(0, 2, 1)`` of a 3-D ``x``, else None."""
    if (not isinstance(ce_input, fx.Node) or len(ce_input.users) != 1
            or _val(ce_input.args[0] if ce_input.args else None) is None):
        return None
    if _is_method(ce_input, "transpose") or _is_function(ce_input, torch.transpose):
        swapped = sorted(d % 3 for d in ce_input.args[1:3]) if len(ce_input.args) == 3 else None
        if swapped != [1, 2]:
            return None
    elif _is_method(ce_input, "permute") or _is_function(ce_input, torch.permute):
        order = ce_input.args[1] if len(ce_input.args) == 2 else ce_input.args[1:]
        if not all(isinstance(d, int) for d in order) or [d % 3 for d in order] != [0, 2, 1]:
            return None
    else:
        return None
    return ce_input.args[0]


def _match_one(loss_node: fx.Node) -> LMHeadLossMatch:
    is_nll = _is_function(loss_node, *_NLL_TARGETS)
    loss_name = "nll_loss" if is_nll else "cross_entropy"
    kw = _normalized_kwargs(loss_node)
    if kw is None:
        raise _Refuse(CODES.loss_arguments, f"could not normalize the {loss_name} call")
    if kw.get("weight") is not None:
        raise _Refuse(CODES.loss_arguments, f"{loss_name} with class weights is not fused (not reproduced exactly)")
    if kw.get("size_average") is not None or kw.get("reduce") is not None:
        raise _Refuse(CODES.loss_arguments, "legacy size_average/reduce arguments")
    reduction = kw.get("reduction", "mean")
    if reduction not in ("mean", "sum", "none"):
        raise _Refuse(CODES.loss_arguments, f"reduction {reduction!r}")
    label_smoothing = kw.get("label_smoothing", 0.0)
    ignore_index = kw.get("ignore_index", -100)
    if not isinstance(label_smoothing, (int, float)) or not isinstance(ignore_index, int):
        raise _Refuse(CODES.loss_arguments, "label_smoothing / ignore_index are not constants")
    ce_input, target = kw["input"], kw["target"]
    in_val, target_val = _val(ce_input), _val(target)
    if in_val is None or target_val is None:
        raise _Refuse(CODES.no_shape_info, f"no shape information on the {loss_name} inputs")
    if target_val.is_floating_point():
        raise _Refuse(CODES.targets, "targets are class probabilities, not indices")
    if target_val.dtype != torch.int64:
        raise _Refuse(CODES.targets, f"targets are {target_val.dtype}: {loss_name} takes int64 class indices (eager raises)")
    if target_val.dim() != in_val.dim() - 1:
        raise _Refuse(CODES.loss_shape, f"{loss_name} input of shape {tuple(in_val.shape)} with targets of shape "
                      f"{tuple(target_val.shape)} (the fused loss needs [tokens, vocab] and [tokens])")
    loss_side_nodes = []  # nodes between the loss and the logits that the walk below does not see
    if in_val.dim() == 3 and not is_nll:
        # [B, V, S] with the classes in dim 1, the layout CE wants for sequences: fine when it is the
        # [B, S, V] logits transposed (each (b, s) is still one token); the target is [B, S] then
        transposed, ce_input = ce_input, _untransposed_logits(ce_input)
        if ce_input is None:
            raise _Refuse(CODES.loss_shape, f"{loss_name} input of shape {tuple(in_val.shape)} with classes in dim 1 that is not the "
                          "transposed [B, S, vocab] logits")
        loss_side_nodes = [transposed]
        in_val = _val(ce_input)
    elif in_val.dim() != 2:
        raise _Refuse(CODES.loss_shape, f"{loss_name} input of shape {tuple(in_val.shape)} (the fused loss needs [tokens, vocab])")

    if is_nll:  # nll_loss(log_softmax(x)) is cross_entropy(x): fuse from the log-softmax's input
        ce_input, loss_side_nodes = _log_softmax_source(ce_input)
    linear, chain, slices, softcap, (logit_scale, logit_divisor) = _walk_to_linear(ce_input, in_val.shape[-1])
    chain = loss_side_nodes + chain
    hidden, weight = linear.args[0], linear.args[1]
    bias = linear.args[2] if len(linear.args) > 2 else linear.kwargs.get("bias")
    weight_val = _val(weight)
    if weight_val is None or weight_val.dim() != 2:
        raise _Refuse(CODES.lm_head_weight, "lm_head weight is not a 2-D tensor")
    if not torch.is_floating_point(weight_val):
        raise _Refuse(CODES.lm_head_weight, "lm_head weight is not floating point")
    return LMHeadLossMatch(loss_node, linear, hidden, weight, bias, target, ignore_index, reduction,
                           float(label_smoothing), softcap, logit_scale, logit_divisor, slices, chain)


def _predicted_bytes(num_tokens: int, vocab: int, hidden: int, dtype: torch.dtype, chunk: int) -> dict:
    """Extra memory of the loss, eager vs fused (bytes).

    Eager keeps the logits (dtype), their float32 upcast and the float32 grad of the upcast alive at
    the backward's peak: N·V·(a + 4 + 4).  The fused op holds one chunk of float32 logits and their
    gradient (2·C·V·4), the precomputed grad of the hidden states (N·H·a) and a float32 accumulator
    for the weight gradient (V·H·4).
    """
    a = torch.finfo(dtype).bits // 8
    return {
        "eager": num_tokens * vocab * (a + 8),
        "fused": 2 * chunk * vocab * 4 + num_tokens * hidden * a + vocab * hidden * 4,
    }


def fuse_lm_head_loss(gm: fx.GraphModule, *, config, context) -> fx.GraphModule:
    from burstc.kernels.linear_cross_entropy import default_chunk_size

    fake_mode = _fake_mode(gm)
    output_node = next(n for n in reversed(gm.graph.nodes) if n.op == "output")
    drop_from_outputs: list[fx.Node] = []

    for match in find_lm_head_losses(gm, context):
        graph = gm.graph
        chain_nodes = set(match.chain)
        # the logits and every value on the way to the loss (upcast, soft-capped, scaled: Gemma-2, Cohere and
        # Granite return those) that something besides the loss chain uses
        outside_users = {n: [u for u in n.users if u not in chain_nodes and u is not match.loss_node]
                         for n in [match.linear_node, *match.chain]}
        used_outside = [n for n, users in outside_users.items() if users]
        logits_users = [u for users in outside_users.values() for u in users]
        other_users = list(dict.fromkeys(u for u in logits_users if u is not output_node))
        hidden_val, weight_val = _val(match.hidden), _val(match.weight)
        vocab, hidden_size = weight_val.shape
        shift = _slice_as_ignored_targets(match, hidden_val)
        # the op's rows: every hidden row when a token slice becomes ignored targets, else one per target
        num_tokens = hidden_val.numel() // hidden_size if shift else _val(match.target).numel()
        chunk = config.lm_head_chunk_size or default_chunk_size(num_tokens, vocab, hidden_size, hidden_val.dtype)
        with graph.inserting_before(match.loss_node):
            hidden = match.hidden
            for index in ([] if shift else reversed(match.token_slices)):  # innermost slice was appended last
                sliced = graph.call_function(operator.getitem, (hidden, index))
                _set_meta(sliced, operator.getitem, (hidden, index), {}, fake_mode)
                hidden = sliced
            # the targets in the hidden states' token shape ([B, S] for [B, S, H]), so that a row of
            # one is a token of the other whatever the leading dims (and the shard pass can split both)
            lead_shape = shape_args(graph, hidden, range(_val(hidden).dim() - 1), fake_mode)
            if shift:  # the targets of the sliced tokens, then ignore_index where the slice cut
                dim, before, after = shift
                lead_shape = tuple(size - (before + after) if d == dim else size for d, size in enumerate(lead_shape))
            # CE's per-token losses have the target's shape (sizes taken here: inserting_after reverses order)
            loss_shape = None
            if match.reduction == "none":
                loss_shape = shape_args(graph, match.target, range(_val(match.target).dim()), fake_mode)
            target = graph.call_method("reshape", (match.target, lead_shape))
            _set_meta(target, torch.reshape, (match.target, lead_shape), {}, fake_mode)
            if shift:
                pad = [0, 0] * (len(lead_shape) - 1 - dim) + [before, after]
                padded = graph.call_function(F.pad, (target, pad), {"value": match.ignore_index})
                _set_meta(padded, F.pad, (target, pad), {"value": match.ignore_index}, fake_mode)
                target = padded
            kwargs = dict(bias=match.bias, ignore_index=match.ignore_index, reduction=match.reduction,
                          label_smoothing=match.label_smoothing, softcap=match.softcap, chunk_size=chunk)
            if match.logit_scale is not None:
                kwargs["logit_scale"] = match.logit_scale
            if match.logit_divisor is not None:
                kwargs["logit_divisor"] = match.logit_divisor
            fused = graph.call_function(linear_cross_entropy, (hidden, match.weight, target), kwargs)
            _set_meta(fused, linear_cross_entropy, (hidden, match.weight, target), kwargs, fake_mode)
        fused.meta["nn_module_stack"] = match.linear_node.meta.get("nn_module_stack", {})
        result = fused
        if match.reduction == "none":  # per-token losses come in the token shape; give CE's [N] back
            with graph.inserting_after(fused):
                result = graph.call_method("reshape", (fused, loss_shape))
            _set_meta(result, torch.reshape, (fused, loss_shape), {}, fake_mode)
        match.loss_node.replace_all_uses_with(result)
        graph.erase_node(match.loss_node)

        logits_note = "dropped (never materialized)"
        if other_users:
            logits_note = "kept: used by " + ", ".join(u.name for u in other_users)
        elif output_node in logits_users:
            if config.keep_logits:
                logits_note = "kept: keep_logits=True"
            elif config.keep_logits is None and not torch.is_grad_enabled():
                logits_note = "kept: compiled without gradients (evaluation; keep_logits=False drops them)"
            else:
                drop_from_outputs.extend(n for n in used_outside if output_node in n.users)
                logits_note = "dropped: returned as a stand-in that explains keep_logits (True keeps them)"
        context.rewrite(KIND, fused, {
            "tokens": num_tokens, "vocab": vocab, "hidden": hidden_size,
            "dtype": dtype_name(hidden_val.dtype),
            "reduction": match.reduction, "ignore_index": match.ignore_index,
            "label_smoothing": match.label_smoothing, "softcap": match.softcap, "logit_scale": match.logit_scale,
            "logit_divisor": match.logit_divisor,
            "bias": match.bias is not None, "chunk_size": chunk, "logits": logits_note,
            "sliced_tokens": (f"dim {shift[0]}: {shift[1]} before, {shift[2]} after, as ignored targets"
                              if shift else None),
            "predicted_peak_bytes": _predicted_bytes(num_tokens, vocab, hidden_size, hidden_val.dtype, chunk),
        }, module=module_path(match.linear_node))
    if drop_from_outputs:
        context.facts.dropped_outputs = drop_graph_outputs(output_node, drop_from_outputs,
                                                           context.facts.dropped_outputs)
    eliminate_dead_code(gm.graph)
    return gm


def drop_graph_outputs(output_node: fx.Node, nodes: list[fx.Node], earlier: tuple[int, ...] = ()
                       ) -> tuple[int, ...]:
    """Remove ``nodes`` from the graph's output tuple; the backend returns a stand-in in their place.

    Returns the positions dropped so far in the *original* output tuple (``facts.dropped_outputs``):
    ``earlier`` (drops by earlier passes) merged with these."""
    outputs = tuple(output_node.args[0])
    earlier = sorted(earlier)
    original_index = [i for i in range(len(outputs) + len(earlier)) if i not in earlier]
    drop = {i for i, o in enumerate(outputs) if any(o is n for n in nodes)}
    output_node.args = (tuple(o for i, o in enumerate(outputs) if i not in drop),)
    return tuple(sorted(earlier + [original_index[i] for i in drop]))
