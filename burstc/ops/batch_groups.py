"""A padded batch whose rows disagree runs as groups of batch rows, each with its own padding.

With key padding the ring decides what travels and what is computed from the union over the batch: a key row
travels when it is a real token in SOME batch row, and a block whose keys are real in some rows but not all runs
the position-masked kernel for every row.  A batch of rows of different lengths (an SFT batch padded to its
longest row) then pays for its longest row in every row: a right-padded batch of lengths S, S/2, S/4, S/8 computes
4 x S^2 / 2 score entries for 1.33 x S^2 / 2 real ones, most of them on the slowest kernel, and every rank sends
its K/V for the longest row's extent in all four rows.

Splitting the batch into groups of rows with similar extents (:func:`batch_row_groups`) and running one ring loop
per group (as the head groups run, :func:`burstc.ops.head_groups.run_pipelined`) makes each group's union its own:
a short row's keys past its end neither travel nor get computed, and keys real in every row of a group keep the
flash-style kernels.  Every rank derives the same groups from the replicated ``key_valid`` data, so both sides of
every pair agree on what each group sends.

The grouping: rows sorted by their extent (first to last real key), cut into at most :data:`MAX_BATCH_GROUPS`
contiguous runs of that order by a dynamic program minimizing ``sum over groups of rows x span^2`` (span: the
group's union extent; attention's work and its K/V bytes per row grow with it, quadratically and linearly).  The
batch is split only where that cost falls to :data:`SPLIT_WHEN_AT_MOST` of the unsplit one, and into one more
group only where that cuts the cost by a tenth (:data:`EACH_GROUP_AT_MOST`): each group costs one more message
per step and thinner kernel calls.  Memory: a group's rows of the op's inputs are gathered into
their own tensors (one more copy of the inputs over all groups, none for a group of consecutive rows), while each
loop's transient buffers shrink to its group's share of the batch.

``BURSTC_RING_BATCH_GROUPS=n`` (or :func:`set_batch_groups`) forces at most ``n`` groups (1: off), for
benchmarks and tests; ``n`` > 1 still splits only where the cost falls.
"""
from __future__ import annotations

import dataclasses

import torch
from torch import Tensor

from burstc.ops import host_reads
from burstc.ops.split_limit import SplitLimit

MAX_BATCH_GROUPS = 4
SPLIT_WHEN_AT_MOST = 0.75  # the groups' cost over the unsplit batch's, at most
EACH_GROUP_AT_MOST = 0.9  # a further group: the cost with it over the cost without, at most

Rows = slice | Tensor  # a group's batch rows: a slice when consecutive, else an int64 index (ascending)

_LIMIT = SplitLimit("BURSTC_RING_BATCH_GROUPS", "batch groups")
set_batch_groups = _LIMIT.set  # at most n batch groups per ring call (1: the whole batch as one); None: automatic
batch_groups_forced = _LIMIT.forced


def row_extents(key_valid_BS: Tensor) -> tuple[list[int], list[int]]:
    """``(first, stop)`` of each batch row's real keys (``stop`` one past the last; ``(0, 0)`` for a row with none)."""
    seq_len = key_valid_BS.shape[1]
    index_S = torch.arange(seq_len, device=key_valid_BS.device)
    first_B = torch.where(key_valid_BS, index_S, seq_len).amin(1)
    stop_B = torch.where(key_valid_BS, index_S + 1, 0).amax(1)
    first_B = torch.where(stop_B > 0, first_B, 0)
    return first_B.tolist(), stop_B.tolist()


def partition_rows(first: list[int], stop: list[int], max_groups: int) -> list[list[int]]:
    """The batch rows cut into at most ``max_groups`` groups minimizing ``sum rows x span^2``, each group a run of
    the rows sorted by extent, rows ascending within a group; one group (every row) unless that cost falls to
    :data:`SPLIT_WHEN_AT_MOST` of the unsplit batch's."""
    batch = len(first)
    rows = list(range(batch))
    if batch < 2 or max_groups < 2:
        return [rows]
    order = sorted(rows, key=lambda b: (stop[b] - first[b], first[b], b))
    first_T = torch.tensor([first[b] for b in order], dtype=torch.float64)
    stop_T = torch.tensor([stop[b] for b in order], dtype=torch.float64)
    empty_T = stop_T <= first_T  # rows with no real key widen no group's span
    # span[i, j]: the union extent of sorted rows i..j (j >= i)
    big = float(max(stop) + 1)
    lo_T = torch.where(empty_T, big, first_T)
    hi_T = torch.where(empty_T, 0.0, stop_T)
    span_II = torch.full((batch, batch), float("inf"), dtype=torch.float64)
    for i in range(batch):
        lo = torch.cummin(lo_T[i:], 0).values
        hi = torch.cummax(hi_T[i:], 0).values
        span_II[i, i:] = (hi - lo).clamp(min=0)
    count_II = (torch.arange(batch)[None, :] - torch.arange(batch)[:, None] + 1).to(torch.float64)
    cost_II = torch.where(count_II > 0, count_II * span_II ** 2, float("inf"))  # rows i..j as one group
    # best[g][j]: the least cost of sorted rows 0..j in g + 1 groups; cut[g][j]: where its last group starts
    best = [cost_II[0]]
    cuts = [torch.zeros(batch, dtype=torch.int64)]
    for _ in range(1, min(max_groups, batch)):
        previous = torch.cat([torch.zeros(1, dtype=torch.float64), best[-1][:-1]])  # rows 0..i-1 done before i
        value, start = (previous[:, None] + cost_II).min(0)  # the last group is rows i..j
        best.append(value)
        cuts.append(start)
    costs = [float(b[-1]) for b in best]
    used = 0  # one more group only while it cuts the cost by a tenth
    while used + 1 < len(costs) and costs[used + 1] <= EACH_GROUP_AT_MOST * costs[used]:
        used += 1
    if used == 0 or costs[used] > SPLIT_WHEN_AT_MOST * costs[0]:
        return [rows]
    groups, j, g = [], batch - 1, used
    while j >= 0:
        i = int(cuts[g][j]) if g > 0 else 0
        groups.append(sorted(order[i:j + 1]))
        j, g = i - 1, g - 1
    return sorted(groups)


@dataclasses.dataclass(frozen=True)
class BatchGroup:
    """A group's batch rows and the call's mask data restricted to them (:class:`burstc.ops.ring_loops.MaskData`)."""

    rows: Rows
    data: object


def row_count(rows: Rows, batch: int) -> int:
    """How many of a batch of ``batch`` rows ``rows`` selects."""
    return len(range(batch)[rows]) if isinstance(rows, slice) else rows.numel()


def rows_of(members: list[int], device) -> Rows:
    """A slice for consecutive rows, else an index tensor."""
    if members == list(range(members[0], members[-1] + 1)):
        return slice(members[0], members[-1] + 1)
    return host_reads.to_device(torch.tensor(members, dtype=torch.int64), device)


def take_rows(t: Tensor | None, rows: Rows) -> Tensor | None:
    """Rows ``rows`` of ``t`` along dim 0 (a view for a slice, a gathered copy for an index)."""
    if t is None or (isinstance(rows, slice) and rows == slice(None)):
        return t
    return t[rows] if isinstance(rows, slice) else t.index_select(0, rows)


def place_rows_(output: Tensor, rows: Rows, heads: slice, part: Tensor) -> None:
    """Write ``part`` into heads ``heads`` of ``output``'s batch rows ``rows``."""
    target = output[:, heads]
    if isinstance(rows, slice):
        target[rows].copy_(part)
    else:
        target.index_copy_(0, rows, part.to(target.dtype))


def batch_row_groups(data, batch: int) -> list[BatchGroup]:
    """The call's batch groups: one (every row, ``data`` as it is) unless key padding makes rows disagree enough
    (:func:`partition_rows`)."""
    whole = [BatchGroup(slice(None), data)]
    key_valid_BS = data.key_valid_BS
    if key_valid_BS is None or batch < 2:
        return whole
    limit = _LIMIT.requested() or MAX_BATCH_GROUPS
    if limit < 2:
        return whole
    host = data.host  # decided on the host copy (burstc.ops.host_reads): no synchronization per call on a GPU
    first, stop = row_extents(host.key_valid_BS)
    members = partition_rows(first, stop, limit)
    if len(members) < 2:
        return whole
    groups = []
    for rows in members:
        selected = rows_of(rows, key_valid_BS.device)
        # on the CPU the group's data are their own host copy
        group_host = None if host is data else _data_rows(host, rows_of(rows, host.key_valid_BS.device))
        groups.append(BatchGroup(selected, _data_rows(data, selected, host_data=group_host)))
    return groups


def _data_rows(data, rows, **changes):
    """``data`` (a :class:`burstc.ops.ring_loops.MaskData`) with its batch rows ``rows`` only."""
    return dataclasses.replace(data, doc_ids_BS=take_rows(data.doc_ids_BS, rows),
                               key_valid_BS=take_rows(data.key_valid_BS, rows), **changes)
