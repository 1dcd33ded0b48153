"""The cost model: how long one ring attention takes per rank — flat ring, double ring or the hybrid — and which to run.

Per compute step, the work is the score entries of the step's pair (:func:`burstc.block_geometry.blocks`
of the mask's static part, times B * Hq), at ``4 * D`` FLOPs an entry in the forward (QK^T and PV) and
``10 * D`` in the backward (QK^T again, dP, dV, dQ, dK); the bytes are the planner's per step and link
class (:func:`burstc.planner.predicted_transfers` / :func:`~burstc.planner.predicted_double_ring_transfers`).
Overlap is modelled as the ops run it:

* flat ring: the transfers posted at step s travel while step s computes: ``sum_s max(compute_s, comm_s)``,
  ``comm_s`` the slowest link class of the step (bytes / bandwidth + latency per message);
* double ring: the inter-node transfers posted in outer step j travel while its G inner steps run:
  ``sum_j max(sum_i max(compute_ji, intra_ji), inter_j)``;
* the hybrid (:mod:`burstc.ops.ulysses`): its all-to-alls inside the node (not hidden), then the flat ring
  across the nodes on node shards of H/G heads;
* the backward's extra hops (gradients going home after the last step) are not hidden;
* a call split into head groups (:mod:`burstc.ops.head_groups`): what one group's schedule exposes beyond
  ``max(compute, busiest link)`` falls by the group count.

A rank's time is its own sum; the call's is the slowest rank's.  The model knows nothing of kernel
efficiency at small blocks, of CPU contention between ranks, or of the merge's cost; the benchmark
``benchmarks/topology.py`` compares it with measured steps.
"""
from __future__ import annotations

import dataclasses
import functools

import torch

from burstc.block_geometry import GridPosition, blocks
from burstc.ops.head_groups import shard_head_groups

FLOPS_PER_ENTRY_PER_DIM = {"forward": 4, "backward": 10}


@dataclasses.dataclass(frozen=True)
class Machine:
    """Throughput of one device and its links: attention FLOP/s, bytes/s and seconds of latency per message,
    per link class (``"intra"``: inside a node, ``"inter"``: between nodes)."""

    attention_flops: float
    bandwidth: tuple[tuple[str, float], ...]
    latency: tuple[tuple[str, float], ...] = (("intra", 0.0), ("inter", 0.0))

    def seconds(self, link: str, nbytes: int) -> float:
        if not nbytes:
            return 0.0
        link = "inter" if link == "ring" else link  # a flat ring whose nodes are unknown: the slower class
        return nbytes / dict(self.bandwidth)[link] + dict(self.latency).get(link, 0.0)


# An H100 cluster (NVLink 450 GB/s inside a node, 400 Gb/s InfiniBand = 50 GB/s between, ~400 TFLOP/s of
# bf16 attention), and the same compute-to-bandwidth ratios on this CPU as the emulated cluster calibrates
# them (../shared/tools/emulated-cluster: 4 ranks on 2 cores, fp32 standing in for bf16).
H100_CLUSTER = Machine(attention_flops=400e12, bandwidth=(("intra", 450e9), ("inter", 50e9)))
CPU_AS_H100_CLUSTER = Machine(attention_flops=45e9, bandwidth=(("intra", 101e6), ("inter", 11.3e6)))


@dataclasses.dataclass(frozen=True)
class Device:
    """A named accelerator for ``burstc explain``: its cluster as the cost model sees it (``machine``), its
    peak dense bf16 FLOP/s (the GEMMs outside attention), and its memory."""

    name: str
    machine: Machine
    peak_flops: float
    memory_bytes: int
    source: str


# Per GPU, one direction.  attention_flops: what FlashAttention-2/3 reach on the card in bf16 (forward + backward),
# not the peak.  Inter-node: one InfiniBand port's share per GPU.
DEVICES = {
    "H100": Device("H100", H100_CLUSTER, peak_flops=989e12, memory_bytes=80 * 2**30, source=(
        "H100 SXM: 989 TFLOP/s dense bf16; NVLink 4 900 GB/s both ways = 450 GB/s each; 400 Gb/s NDR InfiniBand "
        "per GPU = 50 GB/s; ~400 TFLOP/s FlashAttention bf16")),
    "A100": Device("A100", Machine(attention_flops=200e12, bandwidth=(("intra", 300e9), ("inter", 25e9))),
                   peak_flops=312e12, memory_bytes=80 * 2**30, source=(
        "A100 SXM 80GB: 312 TFLOP/s dense bf16; NVLink 3 600 GB/s both ways = 300 GB/s each; 200 Gb/s HDR "
        "InfiniBand per GPU = 25 GB/s; ~200 TFLOP/s FlashAttention-2 bf16")),
    "A800": Device("A800", Machine(attention_flops=200e12, bandwidth=(("intra", 200e9), ("inter", 12.5e9))),
                   peak_flops=312e12, memory_bytes=80 * 2**30, source=(
        "A800 SXM4 80GB (BurstEngine's cluster): the A100's compute; NVLink capped at 400 GB/s both ways = "
        "200 GB/s each; 4 HDR 200 Gb/s HCAs per 8-GPU node = 12.5 GB/s per GPU; ~200 TFLOP/s FlashAttention-2")),
}


def device(name: str) -> Device:
    """The :data:`DEVICES` entry ``name`` (case-insensitive), or a ``ValueError`` listing them."""
    found = DEVICES.get(name.upper())
    if found is None:
        raise ValueError(f"unknown device {name!r}; known: {', '.join(DEVICES)}")
    return found


def default_machine(device_type: str) -> Machine:
    return H100_CLUSTER if device_type == "cuda" else CPU_AS_H100_CLUSTER


def machine_from_options(device_type: str, link_bandwidth: dict | None, compute_flops: float | None) -> Machine:
    """The default machine for ``device_type`` with the user's ``link_bandwidth`` / ``compute_flops`` over it."""
    machine = default_machine(device_type)
    bandwidth = dict(machine.bandwidth)
    bandwidth.update(dict(link_bandwidth or {}))
    return dataclasses.replace(machine, attention_flops=compute_flops or machine.attention_flops,
                               bandwidth=tuple(sorted(bandwidth.items())))


@dataclasses.dataclass(frozen=True)
class RingCost:
    """Predicted seconds of one call on its slowest rank: ``forward``, ``backward``, and their ``compute`` alone."""

    forward: float
    backward: float
    compute: float

    @property
    def total(self) -> float:
        return self.forward + self.backward


@functools.lru_cache(maxsize=1 << 16)  # a call asks every (rank, visitor) pair twice: 8192 pairs at P = 64
def _step_entries(layout: str, mask, local_len: int, size: int, q_owner: int, kv_owner: int) -> int:
    return sum(block.score_entries for block in blocks(layout, mask, q_owner, kv_owner, local_len, size))


@functools.lru_cache(maxsize=256)  # every layer of a model asks the same
def predicted_ring_cost(ring: str, layout: str, mask, seq_len: int, nodes: int, per_node: int, batch: int,
                        heads_q: int, heads_kv: int, head_dim: int, dtype: torch.dtype, plan: str,
                        machine: Machine) -> RingCost:
    """The cost of ``ring`` (``"flat"`` over the flattened ``nodes x per_node`` mesh, or ``"double"``) for one
    attention call with backward ``plan``, under ``mask``'s static part."""
    from burstc.planner import predicted_double_ring_transfers, predicted_transfers

    mask = mask.static_part
    if ring == "ulysses":  # the all-to-alls inside the node, then a flat ring across nodes on node shards
        across = predicted_ring_cost("flat", layout, mask, seq_len, nodes, 1, batch, heads_q // per_node,
                                     heads_kv // per_node, head_dim, dtype, plan, machine)
        forward_a2a, backward_a2a = ulysses_bytes(seq_len // (nodes * per_node), per_node, batch, heads_q, heads_kv,
                                                  head_dim, dtype)
        return RingCost(forward=across.forward + machine.seconds("intra", forward_a2a),
                        backward=across.backward + machine.seconds("intra", backward_a2a), compute=across.compute)
    size = nodes * per_node
    local_len = seq_len // size
    args = (layout, mask, seq_len)
    shape = (batch, heads_q, heads_kv, head_dim, dtype)
    if ring == "double":
        transfers = predicted_double_ring_transfers(*args, nodes, per_node, *shape)
    else:
        transfers = predicted_transfers(*args, size, *shape, per_node=per_node)
    groups = shard_head_groups(batch, heads_kv, local_len, head_dim, dtype, size, bool(mask.score_mods))
    worst = {"forward": 0.0, "backward": 0.0, "compute": 0.0}
    for rank in range(size):
        position = GridPosition(nodes, per_node, rank)
        visitors = [position.seq_rank(-(s // per_node), -(s % per_node)) if ring == "double" else (rank - s) % size
                    for s in range(size)]
        compute_total = 0.0
        for op, key in (("forward", "forward"), ("backward", plan)):
            queries_travel = key == "burst"
            flops = FLOPS_PER_ENTRY_PER_DIM[op] * head_dim * batch * heads_q
            compute = [flops * _step_entries(layout, mask, local_len, size,
                                             *((v, rank) if queries_travel else (rank, v))) / machine.attention_flops
                       for v in visitors]
            compute_total += sum(compute)
            links = transfers[key].sent_by_link_per_step[rank] if size > 1 else ()
            seconds = _double_ring_seconds if ring == "double" else _flat_ring_seconds
            worst[op] = max(worst[op], _pipelined(seconds(compute, links, machine, per_node), compute, links,
                                                  machine, groups))
        worst["compute"] = max(worst["compute"], compute_total)
    return RingCost(**worst)


def ulysses_bytes(local_len: int, per_node: int, batch: int, heads_q: int, heads_kv: int, head_dim: int,
                  dtype: torch.dtype) -> tuple[int, int]:
    """Bytes each rank sends in the hybrid's all-to-alls (``(G - 1) / G`` of each tensor leaves the rank):
    forward q, k, v out and the output and fp32 LSE back; backward grad_out, q, k, v, out, LSE out and
    dq, dk, dv back."""
    element = torch.empty((), dtype=dtype).element_size()
    token_q, token_kv = batch * heads_q * head_dim * element, batch * heads_kv * head_dim * element
    lse = batch * heads_q * 4
    share = local_len * (per_node - 1) // per_node
    forward = share * (2 * token_q + 2 * token_kv + lse)
    backward = share * (3 * token_q + 2 * token_kv + lse) + share * (token_q + 2 * token_kv)
    return forward, backward


def _slowest(links: dict[str, int], machine: Machine, classes=None) -> float:
    return max((machine.seconds(link, nbytes) for link, nbytes in links.items()
                if classes is None or link in classes), default=0.0)


def _flat_ring_seconds(compute: list[float], links, machine: Machine, per_node: int) -> float:
    total = sum(max(c, _slowest(links[s], machine) if s < len(links) else 0.0) for s, c in enumerate(compute))
    return total + sum(_slowest(step, machine) for step in links[len(compute):])  # the backward's last hop


def _pipelined(one_group: float, compute: list[float], links, machine: Machine, groups: int) -> float:
    """A call run as ``groups`` head groups (:mod:`burstc.ops.head_groups`): what one group's schedule leaves
    exposed beyond ``max(compute, the busiest link's time)`` falls by the group count (each group's first transfer
    travels behind the one before it, its last hop behind the one after)."""
    if groups == 1:
        return one_group
    busiest = max((machine.seconds(link, sum(step.get(link, 0) for step in links))
                   for link in {link for step in links for link in step}), default=0.0)
    floor = max(sum(compute), busiest)
    return floor + max(0.0, one_group - floor) / groups


def _double_ring_seconds(compute: list[float], links, machine: Machine, per_node: int) -> float:
    total = 0.0
    for j in range(len(compute) // per_node):
        steps = range(j * per_node, (j + 1) * per_node)
        inner = sum(max(compute[s], _slowest(links[s], machine, ("intra",)) if s < len(links) else 0.0)
                    for s in steps)
        inter = machine.seconds("inter", sum(links[s].get("inter", 0) for s in steps if s < len(links)))
        total += max(inner, inter)
    return total + sum(_slowest(step, machine) for step in links[len(compute):])


def choose_ring(layout: str, mask, seq_len: int, nodes: int, per_node: int, batch: int, heads_q: int,
                heads_kv: int, head_dim: int, dtype: torch.dtype, plan_of, machine: Machine,
                candidates=("double", "ulysses", "flat")) -> tuple[str, dict]:
    """``(ring, {ring: RingCost})``: of ``candidates``, the first listed whose predicted forward + backward is
    within :data:`NEAR_TIE` of the lowest: where compute hides every transfer the plans tie, and the first (the
    double ring, then the hybrid) sends G times fewer bytes between nodes than the flat ring, which the model's
    bandwidths may understate.  ``plan_of(ring)``: the backward plan that ring would run."""
    costs = {ring: predicted_ring_cost(ring, layout, mask, seq_len, nodes, per_node, batch, heads_q, heads_kv,
                                       head_dim, dtype, plan_of(ring), machine) for ring in candidates}
    fastest = min(cost.total for cost in costs.values())
    best = next(ring for ring in candidates if costs[ring].total <= fastest * (1 + NEAR_TIE))
    return best, costs


NEAR_TIE = 0.01
"""Predicted times within 1% count as a tie (:func:`choose_ring`)."""


# ---------------------------------------------------------------------------------------------
# layout="auto": the sequence layout of a graph, chosen over all its ring attentions

AUTO_LAYOUT_ORDER = ("zigzag", "contiguous", "striped")
"""The candidates of ``layout="auto"``, in the order exact ties go (zigzag: the default before ``auto``)."""


@dataclasses.dataclass(frozen=True)
class RingShape:
    """One ring attention as the layout choice sees it: the mask (its static part decides) and the shapes."""

    mask: object  # burstc.attention_ir.MaskSpec
    batch: int
    heads_q: int
    heads_kv: int
    head_dim: int
    dtype: torch.dtype


@dataclasses.dataclass(frozen=True)
class LayoutCost:
    """One candidate layout over all of a graph's ring attentions (each on its slowest / busiest rank, summed over
    the attentions: each is a synchronization point): predicted forward + backward ``seconds``, ``work`` (score
    entries, B * Hq * visible pairs, of the forward) and ``bytes`` sent (forward + the backward plan), at the
    sequence length the layout pads to (``padded_len``)."""

    seconds: float
    work: int
    bytes: int
    padded_len: int

    def as_details(self) -> dict:
        return {"seconds": float(f"{self.seconds:.4g}"), "busiest_work": self.work, "busiest_bytes": self.bytes,
                "padded_len": self.padded_len}


@dataclasses.dataclass(frozen=True)
class LayoutChoice:
    """``layout``: the chosen one; ``costs``: each feasible candidate's :class:`LayoutCost`; ``excluded``:
    candidate -> why not (padding a mask would let a real token see); ``reason``: the choice in words."""

    layout: str
    costs: dict
    excluded: dict
    reason: str


def choose_layout(calls, seq_len: int, world_size: int, machine: Machine, plan: str = "auto",
                  pads_hidden: bool = True) -> LayoutChoice:
    """The layout of ``AUTO_LAYOUT_ORDER`` for a graph whose ring attentions are ``calls`` (:class:`RingShape`,
    one per attention, repeats included) on a flat ring of ``world_size`` ranks.

    Without a sliding window (causal, full, documents: their static part): the least work on the busiest rank
    summed over the calls, then the fewest bytes, then the order: causal gets zigzag, whose work is exactly even.
    With a window in any call: the fastest by :func:`predicted_ring_cost` summed over the calls, candidates within
    :data:`NEAR_TIE` of it going to the least work, then bytes, then the order.  Work alone would pick ``striped``
    for a window: it spreads the short rows of the sequence start over all ranks (a few % less work on the
    busiest), but then every rank needs every other's whole shard, and the cost model weighs those bytes against
    the work.  A candidate that must pad ``seq_len`` is excluded unless ``pads_hidden`` (no real token sees a pad).
    ``plan``: the backward plan, or ``"auto"`` for the planner's cheaper one per call and layout."""
    from burstc.attention_ir import SlidingWindow
    from burstc.layout import required_multiple
    from burstc.planner import cheaper_backward, predicted_transfers, predicted_work

    counts: dict[RingShape, int] = {}
    for call in calls:
        counts[call] = counts.get(call, 0) + 1
    costs, excluded = {}, {}
    for layout in AUTO_LAYOUT_ORDER:
        multiple = required_multiple(world_size, layout)
        padded_len = -(-seq_len // multiple) * multiple
        if padded_len != seq_len and not pads_hidden:
            excluded[layout] = (f"length {seq_len} is not a multiple of {multiple} and padding it is not exact for "
                                "these masks")
            continue
        seconds, work, nbytes = 0.0, 0, 0
        for call, count in counts.items():
            mask = call.mask.static_part
            shape = (call.batch, call.heads_q, call.heads_kv, call.head_dim, call.dtype)
            transfers = predicted_transfers(layout, mask, padded_len, world_size, *shape)
            backward = cheaper_backward(transfers) if plan == "auto" else plan
            cost = predicted_ring_cost("flat", layout, mask, padded_len, world_size, 1, *shape, backward, machine)
            seconds += count * cost.total
            work += count * call.batch * call.heads_q * max(predicted_work(layout, mask, padded_len,
                                                                           world_size).per_rank)
            nbytes += count * (max(transfers["forward"].sent) + max(transfers[backward].sent))
        costs[layout] = LayoutCost(seconds, work, nbytes, padded_len)

    if not costs:  # every candidate must pad: the shard pass refuses the graph (shard.padding_not_exact)
        return LayoutChoice(AUTO_LAYOUT_ORDER[0], costs, excluded, f"{AUTO_LAYOUT_ORDER[0]}: every layout would have "
                            "to pad the sequence, and a real token would see the pads")

    def by_work(layout):
        return costs[layout].work, costs[layout].bytes, AUTO_LAYOUT_ORDER.index(layout)

    if not any(call.mask.static_part.term(SlidingWindow) for call in counts):
        best = min(costs, key=by_work)
        others = ", ".join(f"{layout} {costs[layout].work}" for layout in costs if layout != best)
        reason = (f"{best}: no sliding window, so the least work on the busiest rank, summed over the attentions: "
                  f"{costs[best].work} score entries (vs {others or 'none'})")
        return LayoutChoice(best, costs, excluded, reason)
    fastest = min(cost.seconds for cost in costs.values())
    near = [layout for layout in costs if costs[layout].seconds <= fastest * (1 + NEAR_TIE)]
    best = min(near, key=by_work)
    others = ", ".join(f"{layout} {costs[layout].seconds:.3g}" for layout in costs if layout != best)
    reason = (f"{best}: a sliding window, so the cost model's predicted seconds of ring attention per training step "
              f"decide: {best} {costs[best].seconds:.3g} (vs {others or 'none'})")
    if len(near) > 1:
        reason += (f"; {' and '.join(near)} within {NEAR_TIE:.0%} of the fastest, {best} with the least work on the "
                   f"busiest rank ({costs[best].work}), then bytes ({costs[best].bytes})")
    return LayoutChoice(best, costs, excluded, reason)
