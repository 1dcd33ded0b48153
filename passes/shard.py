"""Sequence-parallel lowering: each rank runs the model on its S/P tokens.

The graph's inputs are the full batch, the same on every rank.  Token-index tensors (ids, labels,
positions) stay **replicated** (R): they are small, and ops that mix positions on them (HF's
pad-and-shift of the labels, ``arange``) stay exact.  A value is **sharded** (``Shard(d)``: this
rank's tokens, in the chosen layout, along dim d) from the first op that turns indices into
activations:

- ``embedding(ids)`` and ``ids.float()`` shard their index input first (``burstc::shard_seq``);
- a position-wise op that meets a sharded operand and a replicated one whose aligned dim has the
  full length S (RoPE tables, ``freqs_cis[:S]``) shards the replicated one there.

Position-wise ops (pointwise, linear, norms over the hidden dims, reshapes that keep the sequence
dim whole, transposes, splits, cats along other dims, RoPE) then run on local tokens; shape
constants that name S are rewritten to S/P.  Causal SDPA becomes ``burstc::ring_attention_forward``
with the planner's backward plan.  The fused LM-head loss takes this rank's targets and the
**global** count of non-ignored tokens (computed on the replicated labels, so no extra
communication), and its partial loss is summed over the mesh by an all-reduce whose backward is
the identity.  Parameter gradients are summed over the mesh in the backward (``reduce_grads``).

Anything the pass does not understand along the sequence axis (an op that mixes positions, a
slice of the sequence, an attention mask, a sharded value it cannot place) makes it refuse the
whole graph with the reason, and the graph runs unsharded: never a wrong result.

The analysis (typed placements, one rule per op family, the ``shard.*`` refusal codes) lives in
:mod:`burstc.sharding`; this file runs it and applies the resulting plan to the graph.
"""
from __future__ import annotations

import dataclasses
import operator

import torch
import torch.fx as fx
import torch.nn.functional as F

import burstc.ops.ring_attention  # noqa: F401  (registers burstc::ring_attention_forward/backward)
from burstc.ops.head_groups import shard_head_groups
from burstc.ops.ring_comm import UlyssesRing, reduction_group
from burstc.attention_ir import Causal, Documents, KeyPadding, MaskSpec, SlidingWindow, document_ids
from burstc.layout import AUTO, DOCUMENTS, required_multiple, static_stand_in
from burstc.ops.linear_cross_entropy import PADDING_TARGET
from burstc.ops.sequence import grad_all_reduce, loss_all_reduce, sum_all_reduce  # also registers burstc::shard_seq/gather_seq
from burstc.passes import ShardingFact, module_path
from burstc.passes.detect_attention import SDPA, attention_call, manual_interior, sdpa_kwargs
from burstc.passes.graph_utils import dtype_name, eliminate_dead_code, fake_mode_of, in_place_writes, is_function, \
    node_named, normalized_kwargs, refresh_meta, set_meta, val, wrap_trained_parameters
from burstc.refusals import PIPELINE, Refused
from burstc.sharding.analysis import Analyzer, Plan, find_sequence_length
from burstc.sharding.codes import CODES
from burstc.sharding.rules import UNFUSED_LOSSES
from burstc.sharding.placements import MergedRows, RowIndex, TuplePlacement, factors

KIND = "shard"
_Analyzer = Analyzer  # the old name, which tests patch


def _group_name(context) -> str:
    mesh = context.mesh
    return mesh.get_group().group_name


def _ring_shape(ring_groups) -> tuple[int, int] | None:
    """``(nodes, ranks per node)`` of a double ring (two group names), else None."""
    if len(ring_groups) != 2:
        return None
    from burstc.ops.ring_comm import resolve_group

    return tuple(resolve_group(name).size() for name in ring_groups)


def _ring_name(ring_groups) -> str:
    if len(ring_groups) == 3:  # ["ulysses", intra, inter]
        from burstc.ops.ring_comm import resolve_group

        return f"ulysses_ring {resolve_group(ring_groups[2]).size()}x{resolve_group(ring_groups[1]).size()}"
    shape = _ring_shape(ring_groups)
    return "flat" if shape is None else f"double {shape[0]}x{shape[1]}"


def _ring_and_plan(config, context, group_name: str, layout: str, mask, seq_len: int, B: int, Hq: int, Hkv: int,
                   D: int, q_val):
    """``(ring group names, backward plan, the planner's MaskedPlan, the chosen plan's, report details)`` of one
    attention: the flat ring over ``group_name``, or on a 2-D mesh (``context.ring_groups``: inter, intra) the
    double ring or the hybrid (``ring=``, or for ``"auto"`` the cost model's fastest); the backward plan is the
    one that sends fewer bytes on that ring."""
    from burstc.cost_model import choose_ring, machine_from_options, ulysses_bytes
    from burstc.ops.ulysses import hybrid_applies
    from burstc.planner import (cheaper_backward, masked_plan, over_bound, predicted_double_ring_transfers,
                                predicted_transfers)

    P, dtype = context.world_size, q_val.dtype
    shape = _ring_shape(context.ring_groups)
    flat_plan = masked_plan(layout, mask, seq_len, P, B, Hq, Hkv, D, dtype).plan
    plan_of, transfers, details = {"flat": flat_plan}, {}, {}
    if shape is not None:
        nodes, per_node = shape
        transfers["double"] = predicted_double_ring_transfers(layout, mask, seq_len, nodes, per_node, B, Hq, Hkv, D,
                                                              dtype)
        plan_of["double"] = cheaper_backward(transfers["double"])
        not_hybrid = hybrid_applies(layout, Hq, Hkv, per_node)
        if not_hybrid is None:
            transfers["ulysses"] = predicted_transfers(layout, mask, seq_len, nodes, B, Hq // per_node,
                                                       Hkv // per_node, D, dtype)
            plan_of["ulysses"] = cheaper_backward(transfers["ulysses"])
        elif config.ring == "ulysses":
            details["ring_note"] = f"ulysses_ring does not apply: {not_hybrid}"
    if config.attention_plan != "auto":
        plan_of = {ring: config.attention_plan for ring in plan_of}
    ring = "flat"
    if shape is not None:
        machine = machine_from_options(q_val.device.type, config.link_bandwidth, config.compute_flops)
        best, costs = choose_ring(layout, mask, seq_len, *shape, B, Hq, Hkv, D, dtype, plan_of.get, machine,
                                  candidates=tuple(r for r in ("double", "ulysses", "flat") if r in plan_of))
        details["predicted_seconds"] = {name: round(cost.total, 6) for name, cost in costs.items()}
        ring = best if config.ring == "auto" else config.ring if config.ring in plan_of else "double"
    plan_name = plan_of[ring]
    planner_plan = cheaper_backward(transfers[ring]) if ring in transfers else flat_plan
    choice = masked_plan(layout, mask, seq_len, P, B, Hq, Hkv, D, dtype, planner_plan)
    chosen = choice if plan_name == choice.plan else masked_plan(layout, mask, seq_len, P, B, Hq, Hkv, D, dtype,
                                                                 plan_name)
    if ring == "double":
        groups = list(context.ring_groups)
    elif ring == "ulysses":
        groups = [UlyssesRing.ULYSSES, context.ring_groups[1], context.ring_groups[0]]
    else:
        groups = [group_name]
    details["ring"] = _ring_name(groups)
    # the head groups the op will run as (burstc.ops.head_groups): the hybrid's ring runs on a node's share of heads
    ring_heads_kv, ring_len, ring_size = (Hkv // shape[1], seq_len // shape[0], shape[0]) if ring == "ulysses" \
        else (Hkv, seq_len // P, P)
    details["head_groups"] = shard_head_groups(B, ring_heads_kv, ring_len, D, dtype, ring_size, bool(mask.score_mods))
    if ring in transfers:
        ops = {"forward": "forward", "backward": plan_name}
        found = transfers[ring]
        if ring == "double":
            by_link = {kind: {link: max(links[link] for links in found[op].sent_by_link) for link in ("inter", "intra")}
                       for kind, op in ops.items()}
        else:  # the hybrid: the ring's bytes cross nodes, the all-to-alls stay inside
            a2a = dict(zip(("forward", "backward"), ulysses_bytes(seq_len // P, shape[1], B, Hq, Hkv, D, dtype)))
            by_link = {kind: {"inter": max(found[op].sent), "intra": a2a[kind]} for kind, op in ops.items()}
        details.update({
            "predicted_bytes": {kind: sum(links.values()) for kind, links in by_link.items()},
            "predicted_bytes_by_link": by_link,
        })
        if ring == "double":
            details["bytes_over_bound"] = {kind: round(over_bound(found[op].received, chosen.bound_per_rank[op]), 4)
                                           for kind, op in ops.items()}
    return groups, plan_name, choice, chosen, details


def _apply(gm, plan: Plan, analyzer: Analyzer, config, context, group_name, document_prices: dict | None = None
           ) -> tuple[list[str], tuple[str, ...], tuple[str, ...]]:
    """Rewrite ``gm`` by ``plan`` -> (names of the outputs gathered, the backward plan and the ring of each ring
    attention).  ``document_prices``: the documents layout's (:func:`_documents_layout`)."""
    graph = gm.graph
    layout = config.layout
    static_layout = static_stand_in(layout)  # what the compile-time formulas use
    shard_cache = {}

    padded_len = analyzer.padded_len
    runtime_data = {}  # (kind, input name) -> the graph value, computed once for every layer
    fake_mode = fake_mode_of(gm)
    # the documents layout: the call's chunk owners, from the replicated ids, before anything is sharded
    owners = (_document_chunks(graph, plan, context, analyzer, fake_mode, runtime_data, document_prices),) \
        if layout == DOCUMENTS else ()

    order = {node: i for i, node in enumerate(graph.nodes)}

    def sharded(inp, dim, pad_value=0.0):
        """``inp`` sharded along ``dim``; ``dim = (d, outer, inner)``: along merged (batch, token, slot) rows in
        dim d (split into [outer, S, inner], sharded, merged back)."""
        key = (inp, dim, pad_value)
        if key not in shard_cache:
            # right after the value, or after the chunk owners when the value (a placeholder) comes first
            anchor = owners[0] if owners and order.get(inp, -1) < order[owners[0]] else inp

            def shard_seq(x, d):
                return graph.call_function(torch.ops.burstc.shard_seq.default,
                                           (x, d, group_name, layout, padded_len, pad_value, *owners))

            with graph.inserting_before(anchor.next):
                shard_cache[key] = _along_merged_rows(graph, inp, MergedRows(*dim), analyzer.S, analyzer.s, shard_seq) \
                    if isinstance(dim, tuple) else shard_seq(inp, dim)
        return shard_cache[key]

    for node, args_kwargs in plan.new_args.items():
        node.args, node.kwargs = args_kwargs
    for node, inputs in plan.shard_inputs.items():
        mapping = {inp: sharded(inp, dim) for inp, dim in inputs.items()}
        node.args = fx.node.map_arg(node.args, lambda a: mapping.get(a, a))
        node.kwargs = fx.node.map_arg(node.kwargs, lambda a: mapping.get(a, a))

    from burstc.planner import predicted_work

    plans, rings = [], []
    for node in plan.attention:
        match = context.facts.attention.get(node)
        call = attention_call(node, match)
        q, k, v = call.query, call.key, call.value
        B, Hq, _, D = val(q).shape
        Hkv, D_v = val(k).shape[1], val(v).shape[-1]
        scale = call.scale if call.scale is not None else D ** -0.5
        mask = _mask_of(node, match)
        # runtime terms hide more: the static part's work bounds it, and its rows are what travel
        balance = predicted_work(static_layout, mask.static_part, analyzer.padded_len, analyzer.P)
        # the ring's blocks take one head width: the narrower side is zero-padded to the wider (DeepSeek's latent
        # attention: q/k 192 wide, v 128): zeros add nothing to q.k and give zero output columns, sliced away
        D_ring = max(D, D_v)
        ring_groups, plan_name, choice, chosen, ring_details = _ring_and_plan(
            config, context, group_name, static_layout, mask.static_part, analyzer.padded_len, B, Hq, Hkv, D_ring,
            val(q))
        # the attention IR's mask is what the op executes; a mask SDPA kept (a window, ALiBi) or a manual
        # attention's insides (a soft-cap) become dead with the node
        assert mask.ring_supported, mask
        with graph.inserting_before(node):
            doc_ids, key_valid = _runtime_mask_data(graph, mask, B, analyzer.padded_len, fake_mode, runtime_data)
            # a model's float fill: its fully hidden rows get eager's uniform average (else calls with such rows
            # run unsharded: _call_checks)
            hidden_rows = match.hidden_rows if match is not None else "zero"
            uniform_keys = analyzer.S if hidden_rows in ("uniform", "uniform_replaced") else 0
            if D_v < D:
                v = graph.call_function(F.pad, (v, (0, D - D_v)))
            elif D < D_v:
                q, k = (graph.call_function(F.pad, (t, (0, D_v - D))) for t in (q, k))
            ring = graph.call_function(torch.ops.burstc.ring_attention_forward.default,
                                       (q, k, v, ring_groups, layout, mask.encode(), float(scale), plan_name,
                                        doc_ids, key_valid, uniform_keys, hidden_rows == "uniform", *owners))
            out = graph.call_function(operator.getitem, (ring, 0))
            if D_v < D:
                out = graph.call_function(operator.getitem, (out, (Ellipsis, slice(0, D_v))))
            if match is not None and match.sink is not None:
                # attention sinks: one more key per head with logit `sink` and a zero value; the keys' share of the
                # row's softmax is exp(lse) / (exp(lse) + exp(sink)) = sigmoid(lse - sink), differentiable in both
                lse = graph.call_function(operator.getitem, (ring, 1))
                gap = graph.call_function(operator.sub, (graph.call_method("unsqueeze", (lse, -1)), match.sink))
                keys_share = graph.call_method("to", (graph.call_function(torch.sigmoid, (gap,)), val(q).dtype))
                out = graph.call_function(operator.mul, (out, keys_share))
        out.meta["nn_module_stack"] = node.meta.get("nn_module_stack", {})
        node.replace_all_uses_with(out)
        graph.erase_node(node)
        plans.append(plan_name)
        rings.append(ring_details["ring"])
        context.rewrite("attention", out, {
            "plan": plan_name, "layout": layout, "causal": mask.term(Causal) is not None, "world_size": analyzer.P,
            # a per-call layout: the compile-time predictions are its static stand-in's (an upper bound)
            "predicted_for_layout": static_layout if static_layout != layout else None,
            "heads": f"{Hq}q/{Hkv}kv", "head_dim": D if D == D_v else f"{D}qk/{D_v}v (ring {D_ring})",
            "local_tokens": analyzer.s,
            "mask": match.mask_description if match else mask.kind,
            "kv_heads_on_wire": Hkv, "gqa_note": match.notes[0] if match and match.notes else None,
            # autocast's matmuls: the ring runs on q, k, v cast to that dtype in the graph (as autocast casts them)
            "cast_to": dtype_name(match.cast_to) if match else None,
            "predicted_bytes": chosen.sent,
            "bytes_bound": chosen.bound,
            "bytes_over_bound": {k: round(x, 4) for k, x in chosen.over_bound.items()},
            "planner_choice": choice.plan,
            "work_max_over_mean": round(balance.max_over_mean, 4),
            "hidden_rows": hidden_rows if hidden_rows != "zero" else None,
            **ring_details,
        }, module=module_path(node))

    for node in plan.losses:
        if is_function(node, *UNFUSED_LOSSES):
            _shard_cross_entropy(graph, node, group_name, layout, padded_len, analyzer.S, plan.merged_rows[node],
                                 analyzer.s, owners)
            continue
        hidden, weight, target = node.args[:3]
        d = analyzer.place(hidden).dim
        ignore_index = node.kwargs.get("ignore_index", -100)
        with graph.inserting_before(node):
            # the fused-loss pass gave the targets the hidden states' token shape: split them alike
            # padded positions (if any) get PADDING_TARGET: they add nothing to the loss, the count or any
            # gradient (an ignore_index row adds eager's 0 x NaN when its hidden states are not finite)
            target_local = graph.call_function(torch.ops.burstc.shard_seq.default,
                                               (target, d, group_name, layout, padded_len, float(PADDING_TARGET),
                                                *owners))
            normalizer = None
            if node.kwargs.get("reduction", "mean") == "mean":
                valid = graph.call_function(operator.ne, (target, ignore_index))
                count = graph.call_method("sum", (valid,))
                normalizer = graph.call_method("to", (count, torch.float32))
        kwargs = dict(node.kwargs)
        if normalizer is not None:
            kwargs["normalizer"] = normalizer
        node.args = (hidden, weight, target_local) + tuple(node.args[3:])
        node.kwargs = kwargs
        with graph.inserting_after(node):
            if node.kwargs.get("reduction", "mean") == "none":
                # per-token losses (the targets' shape): gathered like a sharded output, exactly-once gradients
                total = graph.call_function(torch.ops.burstc.gather_seq.default,
                                            (node, d, group_name, layout, analyzer.S, *owners))
            else:
                total = graph.call_function(loss_all_reduce, (node, reduction_group(group_name)))
        node.replace_all_uses_with(total, delete_user_cb=lambda u: u is not total)

    first_op = next(n for n in graph.nodes if n.op != "placeholder")
    for node, (summed, where, fill) in plan.pads_masked.items():  # the layout's pads must not count in the sum
        x = node.args[summed] if isinstance(summed, int) else node.kwargs[summed]
        outer, inner = factors(where)
        with graph.inserting_before(first_op):  # before everything: sharded() puts its shard right after it
            ones_args, ones_kwargs = ((outer * analyzer.S * inner,),), {"dtype": torch.float32}
            ones = graph.call_function(torch.ones, ones_args, ones_kwargs)
            set_meta(ones, torch.ones, ones_args, ones_kwargs, fake_mode)
        valid = sharded(ones, (0, outer, inner) if isinstance(where, MergedRows) else 0, pad_value=0.0)
        with graph.inserting_before(node):
            shape = [1] * val(x).dim()
            shape[where.dim] = -1
            real = graph.call_function(operator.gt, (graph.call_method("view", (valid, tuple(shape))), 0))
            masked = graph.call_function(torch.where, (real, x, graph.call_function(torch.full_like, (x, fill))))
        if isinstance(summed, int):
            node.update_arg(summed, masked)
        else:
            node.update_kwarg(summed, masked)

    for node in plan.sums_over_ranks:  # this rank's part of a sum over every token: summed over the ranks
        count = plan.means_over_ranks.get(node)
        if count is not None:  # a mean: this rank's sum now, the whole count's division after the all-reduce
            node.target = "sum" if node.op == "call_method" else torch.sum
        reduce = sum_all_reduce if node in plan.sums_with_partial_gradient else loss_all_reduce
        with graph.inserting_after(node):
            total = graph.call_function(reduce, (node, reduction_group(group_name)))
        result = total
        if count is not None:
            with graph.inserting_after(total):
                result = graph.call_function(operator.truediv, (total, count))
        node.replace_all_uses_with(result, delete_user_cb=lambda u: u is not total)

    output_node = next(n for n in reversed(graph.nodes) if n.op == "output")
    gathered = []
    for index, out in plan.outputs_to_gather:
        where = analyzer.place(out)

        def gather_seq(x, d):
            return graph.call_function(torch.ops.burstc.gather_seq.default,
                                       (x, d, group_name, layout, analyzer.S, *owners))

        with graph.inserting_before(output_node):
            full = _along_merged_rows(graph, out, where, analyzer.s, analyzer.S, gather_seq) \
                if isinstance(where, MergedRows) else gather_seq(out, where.dim)
        output_node.args = (tuple(full if (i == index) else o for i, o in enumerate(output_node.args[0])),)
        gathered.append(out.name)

    if config.reduce_grads:
        wrap_trained_parameters(graph, grad_all_reduce, reduction_group(group_name))
    return gathered, tuple(plans), tuple(rings)


def _along_merged_rows(graph: fx.Graph, x: fx.Node, where: MergedRows, length: int, new_length: int, call):
    """``call(y, d)`` where ``x``'s dim ``where.dim`` holds merged (batch, token, slot) rows, ``length`` tokens per
    batch row: ``x`` split to ``[.., outer, length, inner, ..]``, ``call`` on the token dim (sharding it to
    ``new_length`` tokens or gathering it back), merged again.  Only the other dims are read from ``x``'s meta."""
    d, shape = where.dim, list(val(x).shape)
    split = graph.call_method("reshape", (x, tuple(shape[:d] + [where.outer, length, where.inner] + shape[d + 1:])))
    merged = shape[:d] + [where.outer * new_length * where.inner] + shape[d + 1:]
    return graph.call_method("reshape", (call(split, d + 1), tuple(merged)))


def _shard_cross_entropy(graph: fx.Graph, node: fx.Node, group_name: str, layout: str, padded_len: int,
                         seq_len: int, rows, local_len: int, owners: tuple = ()) -> None:
    """``cross_entropy(logits_local, targets)`` (or ``nll_loss``) -> per-token losses of the local rows (this
    rank's targets, padded ones ignored), all-gathered into the full ``[S]`` vector, then reduced as the call
    asked.  ``rows``: the batch rows merged into the token dim of ``[tokens, classes]`` logits (None for CE's
    ``[B, classes, S]`` layout with ``[B, S]`` targets: 3-D logits).

    Exact: the per-token losses are those of one device; the gather's backward hands each rank the
    gradient of its own rows, and the parameter-gradient all-reduce sums the ranks' contributions.
    The mean divides by the count of non-ignored targets, as ``F.cross_entropy`` does (all ignored:
    0 / 0 = nan, like eager).  The gathered vector is S floats: negligible next to the logits.
    """
    kw = normalized_kwargs(node)
    target = kw["target"]
    ignore_index = kw.get("ignore_index", -100)
    reduction = kw.get("reduction", "mean")
    sequence_layout = rows is None
    per_token_kwargs = {"ignore_index": ignore_index, "reduction": "none"}
    if node.target is F.cross_entropy:
        per_token_kwargs["label_smoothing"] = kw.get("label_smoothing", 0.0)
    with graph.inserting_before(node):
        # [rows * S] targets -> [rows, S] -> this rank's [rows, s] (-> [rows * s], the logits' local row order)
        target_rows = target if sequence_layout else graph.call_method("view", (target, (rows, seq_len)))
        target_local = graph.call_function(torch.ops.burstc.shard_seq.default,
                                           (target_rows, 1, group_name, layout, padded_len, float(ignore_index),
                                            *owners))
        if not sequence_layout:
            target_local = graph.call_method("reshape", (target_local, (-1,)))
        per_token_local = graph.call_function(node.target, (kw["input"], target_local), per_token_kwargs)
        per_token_rows = per_token_local if sequence_layout else \
            graph.call_method("view", (per_token_local, (rows, local_len)))
        per_token = graph.call_function(torch.ops.burstc.gather_seq.default,
                                        (per_token_rows, 1, group_name, layout, seq_len, *owners))
        if not sequence_layout:
            per_token = graph.call_method("reshape", (per_token, (-1,)))
        if reduction == "none":
            loss = per_token
        else:
            loss = graph.call_method("sum", (per_token,))
            if reduction == "mean":
                count = graph.call_method("sum", (graph.call_function(operator.ne, (target, ignore_index)),))
                loss = graph.call_function(operator.truediv, (loss, count))
    node.replace_all_uses_with(loss)
    graph.erase_node(node)


def shard(gm: fx.GraphModule, *, config, context) -> fx.GraphModule:
    if context.world_size <= 1:
        context.note = "single device: nothing to shard"
        return gm
    try:
        seq_len = find_sequence_length(gm)
    except ValueError as why:
        context.skip(KIND, "graph", f"{why}; the graph runs unsharded", module="", code=CODES.sequence_length)
        return gm
    if not isinstance(seq_len, int):
        context.skip(KIND, "graph", f"the sequence length is symbolic ({seq_len}): the model was compiled with "
                     "dynamic=True, or dynamic=None after a second length, and the ring attention plans for a "
                     "concrete length; the graph runs unsharded (replicated on every rank). burstc.compile's "
                     "default dynamic=False shards every length (one graph per length)", module="",
                     code=CODES.dynamic_length)
        return gm
    layout_details = {}
    if config.layout == AUTO:
        config, layout_details = _auto_layout(gm, seq_len, config, context)
    multiple = required_multiple(context.world_size, config.layout)
    padded_len = -(-seq_len // multiple) * multiple
    analyzer = _new_analyzer(gm, seq_len, padded_len, config, context)
    try:
        plan = analyzer.run()
    except Refused as refusal:
        context.skip(KIND, refusal.node, f"{refusal}; the whole graph runs unsharded (replicated on every rank)",
                     code=refusal.code)
        return gm
    except Exception as error:  # noqa: BLE001 - the analysis only reads the graph: refusing is always safe
        node = analyzer.current or "graph"
        context.skip(KIND, node, f"the shard pass failed to analyze `{getattr(node, 'name', node)}` "
                                 f"({type(error).__name__}: {error}); the whole graph runs unsharded "
                                 "(replicated on every rank) - please report this", code=CODES.analysis_failed)
        return gm
    if padded_len != seq_len and not all(_pads_hidden(_mask_of(n, context.facts.attention.get(n)))
                                         for n in plan.attention):
        # padding at the end is exact only when no real token can see a pad
        context.skip(KIND, "graph", f"sequence length {seq_len} is not a multiple of {multiple}, which layout "
                                    f"{config.layout!r} needs on {context.world_size} ranks, and padding is exact "
                                    "only when no real token can see a pad (causal attention, documents, key "
                                    f"padding); the graph runs unsharded - pad the batch to a multiple of {multiple} "
                                    "to shard it", module="", code=CODES.padding_not_exact)
        return gm
    if not plan.attention and not plan.losses:
        context.skip(KIND, "graph", "no attention or loss over the sequence found; the graph runs unsharded",
                     module="", code=CODES.no_sequence_work)
        return gm
    if config.layout == DOCUMENTS:
        config, layout_details = _documents_layout(gm, plan, config, context, layout_details)
    if analyzer.output_problem is not None:
        problem = analyzer.output_problem
        context.skip(KIND, problem.node, f"{problem}; the whole graph runs unsharded (replicated on every rank)",
                     code=problem.code)
        return gm
    group_name = _group_name(context)
    call_checks = _call_checks(gm, plan, context)
    gathered, plans, rings = _apply(gm, plan, analyzer, config, context, group_name,
                                    layout_details.get("document_prices"))
    eliminate_dead_code(gm.graph)
    gm.graph.lint()
    refresh_meta(gm)
    context.rewrite(KIND, "graph", {
        "seq_len": seq_len, "world_size": context.world_size, "layout": config.layout,
        "padded_to": padded_len if padded_len != seq_len else None,
        "local_tokens": padded_len // context.world_size, "attention_ops": len(plan.attention),
        "losses": len(plan.losses), "reduce_grads": config.reduce_grads,
        "gathered_outputs": gathered or None, "expert_dispatches": _rank_local_sorts(plan) or None,
        "sums_over_ranks": len(plan.sums_over_ranks) or None,
        "means_over_ranks": len(plan.means_over_ranks) or None,
        "sums_masking_pads": len(plan.pads_masked) or None,
        **layout_details,
    }, module="")
    context.facts.sharding = ShardingFact(world_size=context.world_size, layout=config.layout, plans=plans,
                                          seq_len=seq_len, padded_len=padded_len,
                                          call_checks=call_checks,
                                          ring=" + ".join(sorted(set(rings))) or "flat")
    return gm


def _rank_local_sorts(plan: Plan) -> int:
    """Sorts of token rows each rank runs on its own tokens (a mixture of experts' dispatch: sort, grouped
    matmul, un-permute; see burstc.sharding.dispatch_rules)."""
    return sum(1 for p in plan.placement.values()
               if isinstance(p, TuplePlacement) and len(p) == 2 and isinstance(p[1], RowIndex))


def _new_analyzer(gm, seq_len: int, padded_len: int, config, context) -> Analyzer:
    analyzer = Analyzer(gm, seq_len, context.world_size, config, padded_len)
    analyzer.attention_matches = context.facts.attention
    for match in context.facts.attention.values():
        if match.source in ("manual", "flex") and match.shardable and not is_function(match.node, SDPA):
            # a manual attention left as written: its insides are replaced with it, not sharded one by one
            analyzer.skip_nodes |= manual_interior(match) or set()
    return analyzer


def _auto_layout(gm, seq_len: int, config, context):
    """``layout="auto"``: ``(config with the layout the cost model picks for this graph's ring attentions, the
    shard rewrite's details: the choice, why, and each candidate's numbers)``.  The attentions are those the
    analysis would rewrite (found at a length every candidate holds); one that fails leaves zigzag to the
    analysis below, which refuses the graph with its reason."""
    from burstc.cost_model import RingShape, choose_layout, machine_from_options

    probe_len = -(-seq_len // (2 * context.world_size)) * (2 * context.world_size)
    try:
        attention = _new_analyzer(gm, seq_len, probe_len, config, context).run().attention
    except Exception:  # noqa: BLE001 - refused (with the reason) by the analysis that follows
        return dataclasses.replace(config, layout="zigzag"), {}
    if not attention:
        return dataclasses.replace(config, layout="zigzag"), {"layout_reason": "zigzag: no ring attention"}
    calls, masks, device_type = [], [], "cpu"
    for node in attention:
        match = context.facts.attention.get(node)
        call = attention_call(node, match)
        q = val(call.query)
        B, Hq, _, D = q.shape
        masks.append(_mask_of(node, match))
        calls.append(RingShape(masks[-1], B, Hq, val(call.key).shape[1], D, q.dtype))
        device_type = q.device.type
    if all(m.term(Documents) is not None and m.term(Causal) is not None and m.term(SlidingWindow) is None
           for m in masks) \
            and _ring_shape(context.ring_groups) is None:
        return dataclasses.replace(config, layout=DOCUMENTS), {
            "layout_reason": "documents: every ring attention is causal over packed documents, so each call's chunks "
                             "are assigned to balance its document-causal work (burstc.balance_documents), or "
                             "zigzag's where the cost model predicts them faster for the call (fewer rows received)"}
    machine = machine_from_options(device_type, config.link_bandwidth, config.compute_flops)
    choice = choose_layout(calls, seq_len, context.world_size, machine, config.attention_plan,
                           pads_hidden=all(_pads_hidden(mask) for mask in masks))
    details = {"layout_reason": choice.reason,
               "layout_candidates": {name: cost.as_details() for name, cost in choice.costs.items()}}
    if choice.excluded:
        details["layout_excluded"] = choice.excluded
    return dataclasses.replace(config, layout=choice.layout), details


def _documents_layout(gm: fx.GraphModule, plan: Plan, config, context, details: dict):
    """``layout="documents"`` needs document ids (zigzag, its one-document case, stands in without them) and runs
    on the flat ring (the double ring and the hybrid plan for static layouts)."""
    if not any(_mask_of(n, context.facts.attention.get(n)).term(Documents) is not None for n in plan.attention):
        return dataclasses.replace(config, layout="zigzag"), {
            **details, "layout_reason": "zigzag: no attention of the graph has document ids to balance"}
    too_late = _documents_too_late(gm.graph, plan, context)
    if too_late is not None:
        return dataclasses.replace(config, layout="zigzag"), {**details, "layout_reason": f"zigzag: {too_late}"}
    if _ring_shape(context.ring_groups) is not None and config.ring != "flat":
        details = {**details, "ring_note": "layout 'documents' runs on the flat ring over the whole sequence mesh"}
        config = dataclasses.replace(config, ring="flat")
    return config, {**details, "document_prices": _document_prices(plan, context, config)}


def _document_prices(plan: Plan, context, config) -> dict[str, float]:
    """The cost model's price of one score entry and of one K/V row, summed over the graph's ring attentions: what
    ``burstc::document_chunks`` weighs the balanced chunks' even work against zigzag's fewer rows with."""
    from burstc.cost_model import FLOPS_PER_ENTRY_PER_DIM, machine_from_options
    from burstc.planner import element_size

    seconds_per_entry = seconds_per_row = 0.0
    for node in plan.attention:
        call = attention_call(node, context.facts.attention.get(node))
        q, k = val(call.query), val(call.key)
        machine = machine_from_options(q.device.type, config.link_bandwidth, config.compute_flops)
        flops = sum(FLOPS_PER_ENTRY_PER_DIM.values()) * q.shape[1] * q.shape[3]   # fwd + bwd, every head
        seconds_per_entry += flops / machine.attention_flops
        # a K and a V row of every batch row: forward, then the backward's K/V out and dK/dV back, over the flat
        # ring's slower link class (as the cost model prices a ring whose nodes it does not know)
        row_bytes = 3 * 2 * k.shape[0] * k.shape[1] * k.shape[3] * element_size(k.dtype)
        seconds_per_row += row_bytes / dict(machine.bandwidth)["inter"]
    return {"seconds_per_entry": seconds_per_entry, "seconds_per_row": seconds_per_row}


def _call_checks(gm: fx.GraphModule, plan: Plan, context) -> tuple:
    """``(code, mask, {runtime source: placeholder position})`` for every condition a ring attention to be is
    exact under, one per code and distinct mask: its model fills hidden scores with a float the ring op can't
    mirror (``AttentionMatch.hidden_rows`` None: -inf, a soft-cap, fp16): a call whose data hide a whole row;
    its mask is one ALiBi only for contiguous padding (``KeyPadding.contiguous``): a call with a hole.  Such a
    call runs unsharded (``guards.exactness_guarded``)."""
    from burstc.guards import GUARD_CODES

    position = {n.name: i for i, n in enumerate(n for n in gm.graph.nodes if n.op == "placeholder")}
    checks = {}
    for node in plan.attention:
        match = context.facts.attention.get(node)
        mask = _mask_of(node, match)
        codes = [PIPELINE.hidden_rows_fallback] if match is not None and match.hidden_rows is None else []
        if mask.term(KeyPadding) is not None and mask.term(KeyPadding).contiguous:
            codes.append(GUARD_CODES.padding_hole_fallback)
        for code in codes:
            checks[code, mask] = {source: position[source] for source in mask.runtime_sources}
    return tuple((code, mask, sources) for (code, mask), sources in checks.items())


def _mask_of(node: fx.Node, match) -> MaskSpec:
    """The MaskSpec the ring op executes for attention ``node``: its match's, or SDPA's own is_causal."""
    if match is not None:
        return match.mask
    return MaskSpec.causal() if sdpa_kwargs(node)["is_causal"] else MaskSpec.full()  # detect_attention disabled


def _documents_source(graph: fx.Graph, plan: Plan, context) -> tuple[fx.Node, MaskSpec, int, fx.Node]:
    """``(first ring attention with document ids, its mask, its batch size, the node after which the call's
    chunk owners can be computed)``: after the placeholders for ids an input, else after the value the model
    computes them as and its last in-place write before that attention (torchtitan's ``seq_idx[:, 1:] = ...``)."""
    node, match = next((n, m) for n, m in ((n, context.facts.attention.get(n)) for n in plan.attention)
                       if _mask_of(n, m).term(Documents) is not None)
    mask = _mask_of(node, match)
    source = node_named(graph, mask.term(Documents).source)
    batch = val(attention_call(node, match).query).shape[0]
    if source.op == "placeholder":
        return node, mask, batch, [n for n in graph.nodes if n.op == "placeholder"][-1]
    position = {n: i for i, n in enumerate(graph.nodes)}
    writes = [op for op, aliases in in_place_writes(graph) if source in aliases and position[op] < position[node]]
    return node, mask, batch, max([source, *writes], key=position.get)


def _documents_too_late(graph: fx.Graph, plan: Plan, context) -> str | None:
    """Why the documents layout can't take this graph's document ids, or None: the chunk owners every sharded
    op needs are computed from them, so they must be known before the first op that reads a sharded value."""
    _, mask, _, anchor = _documents_source(graph, plan, context)
    position = {n: i for i, n in enumerate(graph.nodes)}
    early = [n for n in plan.shard_inputs if position[n] <= position[anchor]]
    if early:
        return (f"the document ids `{mask.term(Documents).source}` are computed after `{early[0].name}`, which "
                "already reads sharded tokens")
    return None


def _document_chunks(graph: fx.Graph, plan: Plan, context, analyzer: Analyzer, fake_mode, runtime_data: dict,
                     prices: dict) -> fx.Node:
    """The ``burstc::document_chunks`` node of the documents layout, on the first ring attention's document ids,
    inserted where they are known (after the placeholders, or after the value the model computes them as; from
    replicated inputs, before anything is sharded: ``_documents_too_late``); the ids' node lands in
    ``runtime_data`` for the attentions to reuse.  It gets ``prices`` (:func:`_document_prices`, as the layout's
    details report them), to pick zigzag's chunks per call where they are predicted faster."""
    from burstc.balance_documents import finest_chunks_per_rank

    _, mask, batch, anchor = _documents_source(graph, plan, context)
    with graph.inserting_before(anchor.next):
        doc_ids, _ = _runtime_mask_data(graph, mask, batch, analyzer.padded_len, fake_mode, runtime_data)
        args = (doc_ids, analyzer.P, finest_chunks_per_rank(analyzer.padded_len, analyzer.P),
                prices["seconds_per_entry"], prices["seconds_per_row"])
        owners = graph.call_function(torch.ops.burstc.document_chunks.default, args)
        set_meta(owners, torch.ops.burstc.document_chunks.default, args, {}, fake_mode)
    return owners


def _pads_hidden(mask: MaskSpec) -> bool:
    """Do the layout's pads at the end of the sequence stay invisible to every real token?  Causal: they
    come after it; documents: pads get a document of their own; key padding: pads are invalid keys."""
    return any(mask.term(kind) is not None for kind in (Causal, Documents, KeyPadding))


def padded_document_ids(doc_ids_BS: torch.Tensor, length: int) -> torch.Tensor:
    """``[B, S]`` document ids extended to ``length`` with one new id per row (the pads' own document)."""
    pad = length - doc_ids_BS.shape[-1]
    new_id = doc_ids_BS.amax(-1, keepdim=True) + 1
    return torch.cat([doc_ids_BS, new_id.expand(doc_ids_BS.shape[0], pad)], dim=-1)


def padded_key_valid(key_valid_BS: torch.Tensor, length: int) -> torch.Tensor:
    """``[B, S]`` key validity extended to ``length`` with pads invalid."""
    return torch.nn.functional.pad(key_valid_BS, (0, length - key_valid_BS.shape[-1]), value=False)


def _runtime_mask_data(graph: fx.Graph, mask: MaskSpec, batch: int, padded_len: int, fake_mode, cache: dict):
    """``(doc_ids, key_valid)`` graph values for the mask's runtime terms (None where it has none), computed
    from the replicated token inputs they name (or the replicated value computed from them: a mask_mod's
    document ids): every rank holds the whole batch's, so no communication.
    When the layout pads the sequence, they are extended over the pads (which no real token then sees)."""
    pad_with = {"doc_ids": padded_document_ids, "key_valid": padded_key_valid}

    def value(kind, source, fn, extra):
        if (kind, source) not in cache:
            args = (node_named(graph, source), *extra)
            node = graph.call_function(fn, args)
            set_meta(node, fn, args, {}, fake_mode)
            if val(node).shape[-1] != padded_len:
                padded = graph.call_function(pad_with[kind], (node, padded_len))
                set_meta(padded, pad_with[kind], (node, padded_len), {}, fake_mode)
                node = padded
            cache[kind, source] = node
        return cache[kind, source]

    documents, padding = mask.term(Documents), mask.term(KeyPadding)
    doc_ids = value("doc_ids", documents.source, document_ids, (batch, documents.ids)) if documents else None
    key_valid = value("key_valid", padding.source, torch.ne, (0,)) if padding else None
    return doc_ids, key_valid
