"""A selective checkpoint that keeps part of each ring attention's output: ``checkpoint="selective"`` with
``checkpoint_keep=f < 1``.

``checkpoint_keep=1`` keeps every local row's (O, LSE) and the backward's recompute never runs the ring.  With
``f < 1`` each attention keeps the last ``round(f * s)`` of its ``s`` local rows (local order is increasing global
order in every layout, so under a causal mask those are the costliest rows: they see the most keys) and the
recompute runs the ring forward for the first ``s - kept`` rows only (``query_rows``: it returns just those rows):
their compute, and only the key rows they see travel.  Zigzag at ``f = 0.5`` keeps each rank's late chunk: the recompute computes the early
chunks, which see the earlier ranks' early halves only (a third of a forward's bytes, a quarter of its work).
Memory kept per attention: ``B * Hq * kept * (D + 1)`` values (O in its dtype, LSE fp32) instead of
``B * Hq * s * (D + 1)``.

Torch's selective checkpointing saves or recomputes whole ops, so this is a rewrite of the partitioned graphs
(:func:`keep_attention_rows`): the joint graph is partitioned with the ring recomputed (as ``"layers"``), then the
forward graph also returns a copy of each attention's kept rows (new saved values, first among them) and in the
backward graph the recomputed ring call computes only the other rows and is concatenated with the kept ones (the
backward's transient: the first rows' output, then the whole again, as the forward had it)."""
from __future__ import annotations

import dataclasses

import torch
import torch.fx as fx

RING_FORWARD = torch.ops.burstc.ring_attention_forward.default
_QUERY_ROWS = "query_rows"


@dataclasses.dataclass(frozen=True)
class KeptRows:
    """What one attention keeps and recomputes (per rank)."""

    node: str
    local_rows: int
    kept_rows: int
    kept_bytes: int  # O and LSE of the kept rows
    recompute_bytes_received: int | None  # predicted bytes the recompute receives on the busiest rank (flat ring)

    @property
    def recomputed_rows(self) -> int:
        return self.local_rows - self.kept_rows


def _bound(node: fx.Node) -> dict:
    from burstc.memory import bound_args

    return bound_args(node)


def eligible(node: fx.Node) -> bool:
    """A ring call whose recompute can run on its first rows: a flat or double ring (not the hybrid, whose
    ranks hold other rows after the all-to-all), no uniform hidden rows, not already restricted."""
    args = _bound(node)
    return args["group_names"][0] != "ulysses" and not args["uniform_rows_keys"] and args[_QUERY_ROWS] < 0


def retag_for_recompute(joint: fx.GraphModule) -> int:
    """Tag the eligible ring calls of checkpointed regions (kept whole by ``"selective"``'s policy) for
    recomputation, as ``"layers"`` does; returns how many."""
    from torch.utils.checkpoint import CheckpointPolicy

    count = 0
    for node in joint.graph.nodes:
        if node.target is RING_FORWARD and "recompute" in node.meta and eligible(node):
            node.meta["recompute"] = CheckpointPolicy.PREFER_RECOMPUTE
            count += 1
    return count


def _outputs(ring: fx.Node) -> tuple[fx.Node, fx.Node]:
    """The ring call's ``(out, lse)`` getitem nodes (made when missing)."""
    import operator

    found = {user.args[1]: user for user in ring.users if user.target is operator.getitem}
    for index in (0, 1):
        if index not in found:
            with ring.graph.inserting_after(ring):
                found[index] = ring.graph.call_function(operator.getitem, (ring, index))
                found[index].meta["val"] = ring.meta["val"][index]
    return found[0], found[1]


def _call(graph: fx.Graph, target, args: tuple, fake_mode) -> fx.Node:
    node = graph.call_function(target, args)
    with fake_mode:
        node.meta["val"] = target(*(a.meta["val"] if isinstance(a, fx.Node) else a for a in args))
    return node


def _after(graph: fx.Graph, *nodes: fx.Node):
    """Insert after the last of ``nodes``, new nodes in the order they are made (``inserting_after`` would put
    each right after the anchor, in reverse)."""
    order = {n: i for i, n in enumerate(graph.nodes)}
    return graph.inserting_before(max(nodes, key=order.__getitem__).next)


def _fake_mode(node: fx.Node):
    from torch._guards import detect_fake_mode

    return detect_fake_mode([node.meta["val"][0]])


def keep_attention_rows(fw: fx.GraphModule, bw: fx.GraphModule, keep: float, num_fwd_outputs: int,
                        world_size: int) -> list[KeptRows]:
    """Rewrite the partitioned graphs (the ring recomputed in ``bw``) so that each recomputed ring keeps the last
    ``round(keep * s)`` rows of its forward's output and recomputes the rest; in place.  A ring call of ``bw``
    with no forward call of its name (not a recompute) is left alone."""
    aten = torch.ops.aten
    forward_rings = {n.name: n for n in fw.graph.nodes if n.target is RING_FORWARD}
    fw_output = next(iter(fw.graph.find_nodes(op="output")))
    fw_outs = list(fw_output.args[0])
    saved_names = {n.name for n in fw_outs[num_fwd_outputs:] if isinstance(n, fx.Node)}
    bw_placeholders = list(bw.graph.find_nodes(op="placeholder"))
    # new saved values go first among the saved tensors: in the backward, before the first saved tensor's placeholder
    # (after the saved symbols), or before the tangents when nothing else is saved
    anchor = next((p for p in bw_placeholders if p.name in saved_names and isinstance(p.meta.get("val"), torch.Tensor)),
                  None) or next(p for p in bw_placeholders if p.name.startswith("tangents"))
    new_saved, kept = [], []
    for ring in [n for n in bw.graph.nodes if n.target is RING_FORWARD]:
        forward = forward_rings.get(ring.name)
        if forward is None or not eligible(ring):
            continue
        out_val = ring.meta["val"][0]
        local_rows = out_val.shape[2]
        kept_rows = round(keep * local_rows)
        if not 0 < kept_rows < local_rows:
            continue  # nothing kept (the whole ring recomputed) or everything (never asked: keep < 1)
        rest = local_rows - kept_rows
        fake_mode = _fake_mode(forward)
        fw_out, fw_lse = _outputs(forward)
        with _after(fw.graph, fw_out, fw_lse):  # a copy: a view would keep the whole output alive
            kept_out, kept_lse = (_call(fw.graph, aten.clone.default, (
                _call(fw.graph, aten.slice.Tensor, (part, 2, rest, local_rows), fake_mode),), fake_mode)
                for part in (fw_out, fw_lse))
        new_saved += [kept_out, kept_lse]
        with bw.graph.inserting_before(anchor):
            saved_out = bw.graph.placeholder(f"kept_{kept_out.name}")
            saved_lse = bw.graph.placeholder(f"kept_{kept_lse.name}")
        saved_out.meta["val"], saved_lse.meta["val"] = kept_out.meta["val"], kept_lse.meta["val"]
        ring.kwargs = {**ring.kwargs, _QUERY_ROWS: rest}
        bw_out, bw_lse = _outputs(ring)
        whole = {node: node.meta["val"] for node in (bw_out, bw_lse)}
        with fake_mode:  # the narrowed call returns its first rows only
            narrowed = tuple(t.narrow(2, 0, rest).clone() for t in ring.meta["val"])
        ring.meta["val"], bw_out.meta["val"], bw_lse.meta["val"] = narrowed, *narrowed
        users = {node: list(node.users) for node in (bw_out, bw_lse)}  # before the cats below add theirs
        merged = {}
        with _after(bw.graph, bw_out, bw_lse):
            for part, saved in ((bw_out, saved_out), (bw_lse, saved_lse)):
                # the recomputed first rows, then the kept ones: the forward's (out, lse) again
                merged[part] = bw.graph.call_function(aten.cat.default, ([part, saved], 2))
                merged[part].meta["val"] = whole[part]
        for part, cat in merged.items():
            for user in users[part]:
                user.replace_input_with(part, cat)
        kept_bytes = sum(t.meta["val"].numel() * t.meta["val"].element_size() for t in (kept_out, kept_lse))
        kept.append(KeptRows(ring.name, local_rows, kept_rows, kept_bytes, _predicted_recompute_bytes(ring, rest,
                                                                                                    world_size)))
    if new_saved:
        fw_output.args = (fw_outs[:num_fwd_outputs] + new_saved + fw_outs[num_fwd_outputs:],) + fw_output.args[1:]
        for gm in (fw, bw):
            gm.graph.lint()
            gm.recompile()
    return kept


def _predicted_recompute_bytes(ring: fx.Node, query_rows: int, world_size: int) -> int | None:
    """Bytes the recompute receives on the busiest rank, from the planner (a flat ring, a static layout)."""
    from burstc.attention_ir import MaskSpec
    from burstc.layout import DOCUMENTS
    from burstc.planner import predicted_first_rows_forward

    args = _bound(ring)
    if len(args["group_names"]) != 1 or args["layout"] == DOCUMENTS:
        return None
    batch, heads_q, local_rows, head_dim = args["q"].shape
    transfers = predicted_first_rows_forward(args["layout"], MaskSpec.decode(args["mask"]), query_rows,
                                             local_rows * world_size, world_size, batch, heads_q, args["k"].shape[1],
                                             head_dim, args["q"].dtype)
    return max(transfers.received)
