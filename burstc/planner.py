"""Communication planner for ring attention: bytes each rank sends, per plan, as sympy formulas.

Symbols: ``B`` batch, ``S`` global sequence length, ``P`` ring size, ``Hq`` query heads, ``Hkv``
key/value heads, ``D`` head dim, ``a`` bytes per activation element (q/k/v/dO dtype).  Everything
accumulated or kept as a softmax statistic travels in fp32 (4 bytes).  ``s = S / P`` tokens per rank.

The dense formulas describe exactly what ``burstc.ops.ring_attention`` hands to ``isend`` on every
rank for full attention, where every pair needs every row (the multi-rank tests compare them with its
byte counter):

* total bytes per call (``*_BYTES_PER_CALL``): every tensor of a travelling set is sent P - 1
  times; a travelling gradient accumulator also P - 1 times (P - 2 hops following its block plus
  the last hop home; the owner's own contribution stays home).
* "per step" (``*_BYTES_PER_STEP``, what :class:`AttentionPlan` reports as ``predicted_bytes``)
  is defined as the total per call / (P - 1), i.e. one ring step's share.  The actual sends of the
  backward are staggered (a gradient accumulator trails its block by one step), so an individual
  step may send less or more; the total is exact.

Forward: K, V            -> 2·B·s·Hkv·D·a per step
kv_ring backward: K, V (activation dtype) + dK, dV (fp32)          -> 2·B·s·Hkv·D·(a + 4)
burst backward: Q, dO (activation dtype) + dQ (fp32) + LSE, delta rows (fp32) -> B·s·Hq·(2·D·a + 4·D + 8)

burst/kv_ring = Hq·(2Da + 4D + 8) / (2·Hkv·D·(a + 4)): 0.67 (bf16) and 0.75 (fp32) for MHA at D=128,
so burst wins for MHA and loses as soon as Hq >= 2·Hkv (GQA/MQA; BurstEngine brief §3.2).

Under a mask the op sends a pair only the rows its receiver needs (the mask-aware transfers of
:func:`burstc.block_geometry.travelling_rows`), so the formulas are per row (``*_PER_ROW``: a
travelling row and its returning gradient row) and :func:`predicted_transfers` counts the rows of every
pair, step by step as the op posts them.  The dense formulas above are these per-row formulas times
``s`` rows per pair (tested).  :func:`zero_redundancy_bound` is the bytes each rank must receive when
every row goes once to each rank that needs it, counted from global visibility independently of the
transfers; :func:`masked_plan` puts both beside each other for the report.
"""
from __future__ import annotations

import dataclasses
import functools

import sympy
import torch

from burstc.attention_ir import Causal, SlidingWindow
from burstc.block_geometry import (DoubleRingRoutes, GridPosition, blocks, first_rows_key_rows, runs_length,
                                   travelling_rows, visible_intervals)
from burstc.layout import local_positions

B, S, P, Hq, Hkv, D, a = sympy.symbols("B S P Hq Hkv D a", positive=True, integer=True)
FP32_BYTES = 4
_s = S / P  # tokens per rank

FORWARD_BYTES_PER_STEP = 2 * B * _s * Hkv * D * a
KV_RING_BACKWARD_BYTES_PER_STEP = 2 * B * _s * Hkv * D * a + 2 * B * _s * Hkv * D * FP32_BYTES
BURST_BACKWARD_BYTES_PER_STEP = (2 * B * _s * Hq * D * a          # Q, dO
                                 + B * _s * Hq * D * FP32_BYTES    # travelling dQ accumulator
                                 + 2 * B * _s * Hq * FP32_BYTES)   # LSE and delta rows

# per travelling row: what goes out with it and what returns (gradients, fp32)
FORWARD_BYTES_PER_KV_ROW = 2 * B * Hkv * D * a                                # K, V
KV_RING_BYTES_PER_KV_ROW = {"out": 2 * B * Hkv * D * a, "back": 2 * B * Hkv * D * FP32_BYTES}  # K, V; dK, dV
BURST_BYTES_PER_Q_ROW = {"out": 2 * B * Hq * D * a + 2 * B * Hq * FP32_BYTES,  # Q, dO; LSE, delta
                         "back": B * Hq * D * FP32_BYTES}                      # dQ
BYTES_PER_ROW = {"forward": {"out": FORWARD_BYTES_PER_KV_ROW, "back": sympy.Integer(0)},
                 "kv_ring": KV_RING_BYTES_PER_KV_ROW, "burst": BURST_BYTES_PER_Q_ROW}

_STEPS_PER_CALL = P - 1
FORWARD_BYTES_PER_CALL = _STEPS_PER_CALL * FORWARD_BYTES_PER_STEP
KV_RING_BACKWARD_BYTES_PER_CALL = _STEPS_PER_CALL * KV_RING_BACKWARD_BYTES_PER_STEP
BURST_BACKWARD_BYTES_PER_CALL = _STEPS_PER_CALL * BURST_BACKWARD_BYTES_PER_STEP

BACKWARD_BYTES_PER_STEP = {"kv_ring": KV_RING_BACKWARD_BYTES_PER_STEP, "burst": BURST_BACKWARD_BYTES_PER_STEP}
BACKWARD_BYTES_PER_CALL = {"kv_ring": KV_RING_BACKWARD_BYTES_PER_CALL, "burst": BURST_BACKWARD_BYTES_PER_CALL}

_SYMBOLS = (B, S, P, Hq, Hkv, D, a)


def _bytes(expr: sympy.Expr, values: tuple[int, ...]) -> int:
    """Exact integer value of a byte formula (plan_attention is cached, so sympy speed is fine)."""
    value = expr.subs(dict(zip(_SYMBOLS, values)))
    if not value.is_integer:
        raise ValueError(f"{expr} is not a whole number of bytes at {dict(zip(_SYMBOLS, values))}")
    return int(value)


@dataclasses.dataclass(frozen=True)
class AttentionPlan:
    """The planner's decision for one attention call (all byte counts per rank).

    ``predicted_bytes`` / ``alternative_bytes``: ``{"forward", "backward"}`` per ring step
    (= per call / (P - 1); 0 when P = 1).  ``total_bytes`` / ``alternative_total_bytes``: per call.
    ``expressions``: the sympy per-step formulas (``"forward"``, ``"kv_ring"``, ``"burst"``).
    """

    plan: str
    alternative: str
    predicted_bytes: dict[str, int]
    total_bytes: dict[str, int]
    alternative_bytes: dict[str, int]
    alternative_total_bytes: dict[str, int]
    expressions: dict[str, sympy.Expr]

    @property
    def backward_ratio(self) -> float:
        """Chosen / alternative backward bytes (<= 1; nan when nothing is sent)."""
        other = self.alternative_total_bytes["backward"]
        return self.total_bytes["backward"] / other if other else float("nan")


def element_size(dtype: torch.dtype | int) -> int:
    return dtype if isinstance(dtype, int) else torch.empty((), dtype=dtype).element_size()


@functools.lru_cache(maxsize=1024)
def plan_attention(batch: int, seq_len: int, world_size: int, heads_q: int, heads_kv: int, head_dim: int,
                   dtype: torch.dtype | int) -> AttentionPlan:
    """Bytes of each backward plan for one attention call and the cheaper one (ties: kv_ring).

    ``seq_len`` is the global S (S / world_size tokens per rank); ``dtype`` the activation dtype
    or its element size in bytes.
    """
    if heads_q % heads_kv:
        raise ValueError(f"heads_q ({heads_q}) must be a multiple of heads_kv ({heads_kv})")
    if seq_len % world_size:
        raise ValueError(f"seq_len ({seq_len}) must be a multiple of world_size ({world_size})")
    values = (batch, seq_len, world_size, heads_q, heads_kv, head_dim, element_size(dtype))
    per_step = {plan: _bytes(expr, values) if world_size > 1 else 0 for plan, expr in BACKWARD_BYTES_PER_STEP.items()}
    per_call = {plan: _bytes(expr, values) for plan, expr in BACKWARD_BYTES_PER_CALL.items()}
    chosen = "burst" if per_call["burst"] < per_call["kv_ring"] else "kv_ring"
    other = "kv_ring" if chosen == "burst" else "burst"
    forward_step = _bytes(FORWARD_BYTES_PER_STEP, values) if world_size > 1 else 0
    forward_call = _bytes(FORWARD_BYTES_PER_CALL, values)
    return AttentionPlan(
        plan=chosen,
        alternative=other,
        predicted_bytes={"forward": forward_step, "backward": per_step[chosen]},
        total_bytes={"forward": forward_call, "backward": per_call[chosen]},
        alternative_bytes={"forward": forward_step, "backward": per_step[other]},
        alternative_total_bytes={"forward": forward_call, "backward": per_call[other]},
        expressions={"forward": FORWARD_BYTES_PER_STEP, **BACKWARD_BYTES_PER_STEP},
    )


def max_over_mean(work) -> float:
    """The busiest rank's work over the mean (1.0 when there is none): the balance figure of every layout."""
    mean = sum(work) / len(work)
    return max(work) / mean if mean else 1.0


@dataclasses.dataclass(frozen=True)
class WorkBalance:
    """Unmasked score entries (per batch row and head) each rank computes in one ring attention call, read
    from :func:`burstc.block_geometry.blocks` (what the op computes and its counters count)."""

    per_rank: tuple[int, ...]

    @property
    def max_over_mean(self) -> float:
        return max_over_mean(self.per_rank)


@functools.lru_cache(maxsize=256)
def predicted_work(layout: str, mask, seq_len: int, world_size: int, by_keys: bool = False) -> WorkBalance:
    """Per-rank attention work for ``mask`` (a :class:`burstc.attention_ir.MaskSpec`) in ``layout``: of
    each rank's queries (the forward and the ``kv_ring`` backward), or with ``by_keys`` of each rank's
    keys (the ``burst`` backward, where the queries visit the keys' owner)."""
    if seq_len % world_size:
        raise ValueError(f"seq_len ({seq_len}) must be a multiple of world_size ({world_size})")
    local_len = seq_len // world_size
    pairs = (lambda rank, other: (other, rank)) if by_keys else (lambda rank, other: (rank, other))
    return WorkBalance(tuple(
        sum(block.score_entries for other in range(world_size)
            for block in blocks(layout, mask, *pairs(rank, other), local_len, world_size))
        for rank in range(world_size)))


# ---------------------------------------------------------------------------------------------
# Mask-aware transfers: what each rank sends and receives, and the zero-redundancy bound

_QUERIES_TRAVEL = {"forward": False, "kv_ring": False, "burst": True}


@dataclasses.dataclass(frozen=True)
class Transfers:
    """Bytes per rank and step of one op (``"forward"`` or a backward plan) on every rank, indexed as
    :class:`burstc.ops.ring_stats.RingCallStats` indexes its counters (the forward P steps, the
    backward P + 1)."""

    sent_per_step: tuple[tuple[int, ...], ...]      # [rank][step]
    received_per_step: tuple[tuple[int, ...], ...]
    sent_by_link_per_step: tuple[tuple[dict[str, int], ...], ...] = ()
    """[rank][step] -> bytes sent per link class: ``"ring"`` (a flat ring, nodes not given), ``"intra"``, ``"inter"``."""

    @property
    def sent_by_link(self) -> tuple[dict[str, int], ...]:
        """[rank] -> bytes sent per link class over the call."""
        totals = []
        for steps in self.sent_by_link_per_step:
            total: dict[str, int] = {}
            for links in steps:
                for link, nbytes in links.items():
                    total[link] = total.get(link, 0) + nbytes
            totals.append(total)
        return tuple(totals)

    @property
    def sent(self) -> tuple[int, ...]:
        return tuple(sum(steps) for steps in self.sent_per_step)

    @property
    def received(self) -> tuple[int, ...]:
        return tuple(sum(steps) for steps in self.received_per_step)


def _row_bytes(values: tuple[int, ...]) -> dict[str, dict[str, int]]:
    return {op: {side: _bytes(expr, values) for side, expr in rows.items()} for op, rows in BYTES_PER_ROW.items()}


def _values(batch, seq_len, world_size, heads_q, heads_kv, head_dim, dtype) -> tuple[int, ...]:
    if heads_q % heads_kv:
        raise ValueError(f"heads_q ({heads_q}) must be a multiple of heads_kv ({heads_kv})")
    if seq_len % world_size:
        raise ValueError(f"seq_len ({seq_len}) must be a multiple of world_size ({world_size})")
    return (batch, seq_len, world_size, heads_q, heads_kv, head_dim, element_size(dtype))


@functools.lru_cache(maxsize=256)
def predicted_transfers(layout: str, mask, seq_len: int, world_size: int, batch: int, heads_q: int, heads_kv: int,
                        head_dim: int, dtype: torch.dtype | int, hidden_pairs: frozenset = frozenset(),
                        per_node: int = 0, rows_between=None) -> dict[str, Transfers]:
    """What the ring op sends and receives on every rank for ``mask`` (a
    :class:`burstc.attention_ir.MaskSpec`; its runtime terms are data, so their static part's rows
    travel, except in the pairs the data hide: ``hidden_pairs``, from
    :func:`burstc.block_geometry.pairs_hidden_by_data` when the data are known) in ``layout``:
    ``{"forward", "kv_ring", "burst"}``.  Counted from
    :func:`burstc.block_geometry.travelling_rows`, the function the op's loops call, in the op's order:
    at step t a rank posts its own rows for rank + t + 1 and, from t = 2 on, returns the gradients of the
    rows it received at step t - 1 (the backward's extra last step returns those of step P - 1).
    ``per_node``: ranks per node of a node-major mesh the ring runs over (flattened), to class each send
    as ``"intra"`` or ``"inter"`` by its peer; 0: one class, ``"ring"``.  ``rows_between(queries_travel, receiver,
    sender)``: the rows a call's data make travel instead (packed documents: the rows of the trimmed blocks,
    :func:`burstc.block_geometry.rows_of_blocks`)."""
    values = _values(batch, seq_len, world_size, heads_q, heads_kv, head_dim, dtype)
    per_row = _row_bytes(values)
    size, local_len = world_size, seq_len // world_size

    counted = {}  # each (direction, receiver, sender) is asked for up to 4 times (3 ops, both sides of a pair)

    def rows(op, receiver, sender):
        key = (_QUERIES_TRAVEL[op], receiver % size, sender % size)
        if key not in counted:
            if rows_between is not None:
                counted[key] = runs_length(rows_between(*key))
            else:
                counted[key] = runs_length(travelling_rows(key[0], layout, mask, key[1], key[2], local_len, size,
                                                           hidden_pairs))
        return counted[key]

    def link(rank, peer):
        if not per_node:
            return "ring"
        return "intra" if rank // per_node == (peer % size) // per_node else "inter"

    found = {}
    for op in ("forward", "kv_ring", "burst"):
        steps = size + (0 if op == "forward" else 1) if size > 1 else 0
        sent, received = [[0] * steps for _ in range(size)], [[0] * steps for _ in range(size)]
        by_link = [[{} for _ in range(steps)] for _ in range(size)]
        for rank in range(size):
            def move(step, peer, out_bytes, in_bytes):
                sent[rank][step] += out_bytes
                received[rank][step] += in_bytes
                links = by_link[rank][step]
                links[link(rank, peer)] = links.get(link(rank, peer), 0) + out_bytes

            for step in range(steps):
                if step + 1 < size:  # inputs of compute step step + 1
                    move(step, rank + step + 1, rows(op, rank + step + 1, rank) * per_row[op]["out"],
                         rows(op, rank, rank - step - 1) * per_row[op]["out"])
                if op != "forward" and step - 1 >= 1:  # gradients of compute step step - 1 go back
                    move(step, rank - step + 1, rows(op, rank, rank - step + 1) * per_row[op]["back"],
                         rows(op, rank + step - 1, rank) * per_row[op]["back"])
        found[op] = Transfers(tuple(map(tuple, sent)), tuple(map(tuple, received)),
                              tuple(tuple(steps_) for steps_ in by_link))
    return found


def predicted_first_rows_forward(layout: str, mask, query_rows: int, seq_len: int, world_size: int, batch: int,
                                 heads_q: int, heads_kv: int, head_dim: int, dtype: torch.dtype | int) -> Transfers:
    """:func:`predicted_transfers`' ``"forward"`` for a forward over each rank's first ``query_rows`` query rows
    (a selective checkpoint's recompute of the rows it did not keep): only the key rows those rows see travel
    (:func:`burstc.block_geometry.first_rows_key_rows`, what the op sends), on a flat ring."""
    local_len = seq_len // world_size
    rows = functools.partial(_first_rows_between, layout, mask, query_rows, local_len, world_size)
    return predicted_transfers(layout, mask, seq_len, world_size, batch, heads_q, heads_kv, head_dim, dtype,
                               rows_between=rows)["forward"]


def _first_rows_between(layout, mask, query_rows, local_len, world_size, queries_travel, receiver, sender):
    if queries_travel:  # the backward plans: never asked of a forward-only call
        return ()
    return first_rows_key_rows(layout, mask, query_rows, receiver, sender, local_len, world_size)


@functools.lru_cache(maxsize=256)
def predicted_double_ring_transfers(layout: str, mask, seq_len: int, nodes: int, per_node: int, batch: int,
                                    heads_q: int, heads_kv: int, head_dim: int, dtype: torch.dtype | int,
                                    hidden_pairs: frozenset = frozenset(), rows_between=None
                                    ) -> dict[str, Transfers]:
    """:func:`predicted_transfers` for the double ring on a ``nodes x per_node`` mesh
    (:mod:`burstc.ops.double_ring`), with the bytes per link class.  In the op's order: at the first
    step of outer step j a rank posts the next lane block (inter), at every step the next inner step's
    rows (intra); in the backward, each step returns the last step's intra-node gradients, the second
    step of outer step j >= 2 lane j - 1's inter-node ones, and two extra steps the last ones."""
    size = nodes * per_node
    values = _values(batch, seq_len, size, heads_q, heads_kv, head_dim, dtype)
    per_row = _row_bytes(values)
    local_len = seq_len // size
    found = {}
    for op in ("forward", "kv_ring", "burst"):
        steps = size + (0 if op == "forward" else 2)
        sent, received = [[0] * steps for _ in range(size)], [[0] * steps for _ in range(size)]
        by_link = [[{"intra": 0, "inter": 0} for _ in range(steps)] for _ in range(size)]
        for rank in range(size):
            if rows_between is None:
                rows = functools.partial(travelling_rows, _QUERIES_TRAVEL[op], layout, mask, local_len=local_len,
                                         world_size=size, hidden_pairs=hidden_pairs)
            else:
                rows = functools.partial(rows_between, _QUERIES_TRAVEL[op])
            routes = DoubleRingRoutes(GridPosition(nodes, per_node, rank), rows)

            def move(step, link, kind, out_runs, in_runs):
                out_bytes, in_bytes = (runs_length(r) * per_row[op][kind] for r in (out_runs, in_runs))
                sent[rank][step] += out_bytes
                received[rank][step] += in_bytes
                by_link[rank][step][link] += out_bytes

            for j in range(nodes):
                if j + 1 < nodes:
                    move(j * per_node, "inter", "out", routes.lane_out(j + 1), routes.lane_in(j + 1))
                for i in range(per_node):
                    step = j * per_node + i
                    if i + 1 < per_node:
                        move(step, "intra", "out", routes.intra_out(j, i + 1), routes.intra_in(j, i + 1))
                    if op == "forward":
                        continue
                    last_j, last_i = divmod(step - 1, per_node)
                    if step >= 1 and last_i >= 1:  # the last step's partial gradients go to its lane holder
                        move(step, "intra", "back", routes.intra_in(last_j, last_i), routes.intra_out(last_j, last_i))
                    if i == 1 and j >= 2:
                        move(step, "inter", "back", routes.lane_in(j - 1), routes.lane_out(j - 1))
            if op != "forward":
                move(size, "intra", "back", routes.intra_in(nodes - 1, per_node - 1),
                     routes.intra_out(nodes - 1, per_node - 1))
                move(size + 1, "inter", "back", routes.lane_in(nodes - 1), routes.lane_out(nodes - 1))
        found[op] = Transfers(tuple(map(tuple, sent)), tuple(map(tuple, received)),
                              tuple(tuple(steps_) for steps_ in by_link))
    return found


def _seen_without_window(positions_PS: torch.Tensor, causal: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """``(keys_seen, rows_seeing)`` of :func:`zero_redundancy_bound` for a full or causal mask, in O(P^2 log s):
    rank a sees b's keys up to a's last query (every key when full), and a's queries from b's first key on
    see one of b's (every query when full)."""
    size, local_len = positions_PS.shape
    if not causal:
        return (torch.full((size, size), local_len, dtype=torch.int64),) * 2
    last_P, first_P = positions_PS[:, -1], positions_PS[:, 0]
    keys_seen = torch.searchsorted(positions_PS, last_P.expand(size, -1).contiguous(), right=True).T  # [b, a] -> [a, b]
    rows_seeing = local_len - torch.searchsorted(positions_PS, first_P.expand(size, -1).contiguous())
    return keys_seen.clone(), rows_seeing


def _seen_by_intervals(positions_PS: torch.Tensor, static) -> tuple[torch.Tensor, torch.Tensor]:
    """``(keys_seen, rows_seeing)`` of :func:`zero_redundancy_bound` from each query's visible interval of
    the whole sequence: O(P S) time, O(P s) memory."""
    size, local_len = positions_PS.shape
    seq_len = size * local_len
    owner = torch.empty(seq_len, dtype=torch.int64)
    for r in range(size):
        owner[positions_PS[r]] = r
    everything = torch.arange(seq_len)
    keys_seen = torch.zeros(size, size, dtype=torch.int64)  # [a, b]: keys of b some query of a sees
    rows_seeing = torch.zeros(size, size, dtype=torch.int64)  # [a, b]: queries of a that see a key of b
    for a in range(size):
        lo, hi = visible_intervals(positions_PS[a], everything, static)
        seen = hi > lo
        cover = torch.zeros(seq_len + 1, dtype=torch.int64)
        cover.index_add_(0, lo[seen], torch.ones_like(lo[seen]))
        cover.index_add_(0, hi[seen], -torch.ones_like(hi[seen]))
        keys_seen[a] = torch.bincount(owner[cover.cumsum(0)[:seq_len] > 0], minlength=size)
        # b's keys in each query's [lo, hi), by binary search in b's positions (an [S, P] table of key owners
        # would take 0.5 GiB at S = 1M, P = 64)
        in_window_PS = (torch.searchsorted(positions_PS, hi.expand(size, -1).contiguous())
                        - torch.searchsorted(positions_PS, lo.expand(size, -1).contiguous()))
        rows_seeing[a] = (in_window_PS > 0).sum(1)
    return keys_seen, rows_seeing


@functools.lru_cache(maxsize=256)
def zero_redundancy_bound(layout: str, mask, seq_len: int, world_size: int, batch: int, heads_q: int,
                          heads_kv: int, head_dim: int, dtype: torch.dtype | int) -> dict[str, tuple[int, ...]]:
    """Bytes each rank must receive per call, ``{"forward", "kv_ring", "burst"}``, when every row goes
    once to each rank that needs it: a key/value row to each other rank with a query that sees it (and
    its dK/dV back from there), or a query row to each other rank holding a key it sees (its dQ back).
    Counted from global visibility (``visible_intervals`` over the whole sequence, no pair geometry),
    for the static part of ``mask``."""
    values = _values(batch, seq_len, world_size, heads_q, heads_kv, head_dim, dtype)
    per_row = _row_bytes(values)
    size = world_size
    positions_PS = torch.stack([local_positions(seq_len, size, r, layout) for r in range(size)])  # increasing rows
    static = mask.static_part
    if static.term(SlidingWindow) is None:
        keys_seen, rows_seeing = _seen_without_window(positions_PS, Causal() in static.terms)
    else:
        keys_seen, rows_seeing = _seen_by_intervals(positions_PS, static)
    return _bound_bytes(keys_seen, rows_seeing, per_row)


def _bound_bytes(keys_seen: torch.Tensor, rows_seeing: torch.Tensor, per_row: dict) -> dict[str, tuple[int, ...]]:
    """The bound's bytes per rank from ``keys_seen[a, b]`` (rows of b's keys some query of a sees) and
    ``rows_seeing[a, b]`` (rows of a's queries that see some key of b)."""
    keys_seen, rows_seeing = keys_seen.clone(), rows_seeing.clone()
    keys_seen.fill_diagonal_(0)
    rows_seeing.fill_diagonal_(0)
    kv_in, kv_out = keys_seen.sum(1), keys_seen.sum(0)          # rows a rank needs; its rows others need
    q_in, q_out = rows_seeing.sum(0), rows_seeing.sum(1)        # others' query rows that see a rank's keys; own ones
    bound = {"forward": kv_in * per_row["forward"]["out"],
             "kv_ring": kv_in * per_row["kv_ring"]["out"] + kv_out * per_row["kv_ring"]["back"],
             "burst": q_in * per_row["burst"]["out"] + q_out * per_row["burst"]["back"]}
    return {op: tuple(int(x) for x in b) for op, b in bound.items()}


def data_zero_redundancy_bound(layout, mask, seq_len: int, world_size: int, batch: int, heads_q: int,
                               heads_kv: int, head_dim: int, dtype: torch.dtype | int,
                               doc_ids_BS: torch.Tensor | None = None, key_valid_BS: torch.Tensor | None = None,
                               per_batch_row: bool = False) -> dict[str, tuple[int, ...]]:
    """:func:`zero_redundancy_bound` with the runtime terms' data (``[B, S]``, the call's documents and padding):
    a row is needed where some entry of some batch row that the whole mask leaves visible needs it.
    ``per_batch_row``: each batch row's rows counted alone (where its own entries need them), the bound of a ring
    that sent every batch row separately; the op's batch groups (:mod:`burstc.ops.batch_groups`) lie between the
    two.  Dense per pair of ranks (``B * (S/P)^2`` booleans at a time): for tests, benchmarks and the simulator."""
    from burstc.kernels.masked_attention_blocks import visible_entries

    if per_batch_row and (doc_ids_BS is not None or key_valid_BS is not None):
        total: dict[str, tuple[int, ...]] = {}
        for b in range(batch):
            one = data_zero_redundancy_bound(layout, mask, seq_len, world_size, 1, heads_q, heads_kv, head_dim, dtype,
                                             None if doc_ids_BS is None else doc_ids_BS[b:b + 1],
                                             None if key_valid_BS is None else key_valid_BS[b:b + 1])
            total = {op: tuple(a + c for a, c in zip(total.get(op, (0,) * world_size), got)) for op, got in one.items()}
        return total

    per_row = _row_bytes(_values(batch, seq_len, world_size, heads_q, heads_kv, head_dim, dtype))
    positions = [local_positions(seq_len, world_size, r, layout) for r in range(world_size)]
    keys_seen = torch.zeros(world_size, world_size, dtype=torch.int64)
    rows_seeing = torch.zeros(world_size, world_size, dtype=torch.int64)
    for a in range(world_size):
        for b in range(world_size):
            visible = visible_entries(positions[a], positions[b], mask, doc_ids_BS, key_valid_BS)
            visible = visible.reshape(-1, *visible.shape[-2:]).any(0)      # [S/P queries of a, S/P keys of b]
            keys_seen[a, b], rows_seeing[a, b] = int(visible.any(0).sum()), int(visible.any(1).sum())
    return _bound_bytes(keys_seen, rows_seeing, per_row)


def over_bound(received: tuple[int, ...], bound: tuple[int, ...]) -> float:
    """Max over ranks of received / bound (1.0 where both are 0; inf where the bound is 0 alone)."""
    ratios = [1.0 if got == need == 0 else (got / need if need else float("inf")) for got, need in zip(received, bound)]
    return max(ratios) if ratios else 1.0


def cheaper_backward(transfers: dict[str, Transfers]) -> str:
    """The backward plan whose busiest rank sends fewer bytes under these transfers (ties: kv_ring)."""
    busiest = {plan: max(transfers[plan].sent, default=0) for plan in ("kv_ring", "burst")}
    return "burst" if busiest["burst"] < busiest["kv_ring"] else "kv_ring"


@dataclasses.dataclass(frozen=True)
class MaskedPlan:
    """A mask-aware plan for one attention call: bytes per call, ``{"forward", "backward"}``.

    ``plan``: the backward plan.  ``sent`` / ``received``: what the busiest rank sends / receives;
    ``bound``: the largest per-rank :func:`zero_redundancy_bound`; ``over_bound``: max over ranks of
    received / that rank's bound; ``dense``: what the mask-blind ring sends per rank."""

    plan: str
    transfers: dict[str, Transfers]
    bound_per_rank: dict[str, tuple[int, ...]]
    dense: dict[str, int]

    def _each(self, fn) -> dict:
        return {kind: fn("forward" if kind == "forward" else self.plan) for kind in ("forward", "backward")}

    @property
    def sent(self) -> dict[str, int]:
        return self._each(lambda op: max(self.transfers[op].sent, default=0))

    @property
    def received(self) -> dict[str, int]:
        return self._each(lambda op: max(self.transfers[op].received, default=0))

    @property
    def bound(self) -> dict[str, int]:
        return self._each(lambda op: max(self.bound_per_rank[op], default=0))

    @property
    def over_bound(self) -> dict[str, float]:
        return self._each(lambda op: over_bound(self.transfers[op].received, self.bound_per_rank[op]))


@functools.lru_cache(maxsize=256)
def masked_plan(layout: str, mask, seq_len: int, world_size: int, batch: int, heads_q: int, heads_kv: int,
                head_dim: int, dtype: torch.dtype | int, plan: str = "auto") -> MaskedPlan:
    """The transfers, bound and backward plan (``plan``, or :func:`cheaper_backward` for ``"auto"``)."""
    args = (layout, mask, seq_len, world_size, batch, heads_q, heads_kv, head_dim, dtype)
    transfers = predicted_transfers(*args)
    plan = cheaper_backward(transfers) if plan == "auto" else plan
    dense = plan_attention(batch, seq_len, world_size, heads_q, heads_kv, head_dim, dtype)
    dense_backward = dense.total_bytes["backward"] if plan == dense.plan else dense.alternative_total_bytes["backward"]
    return MaskedPlan(plan, transfers, zero_redundancy_bound(*args),
                      {"forward": dense.total_bytes["forward"], "backward": dense_backward})
