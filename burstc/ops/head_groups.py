"""Fine-grained overlap: a ring call runs as a pipeline of head groups.

A ring loop overlaps a step's transfer with the step before it, but the first transfer has nothing to hide
behind but the local block, and the last compute step and the backward's last hop (the gradients going home)
have nothing beside them at all.  On a double ring this is most of the call: with two nodes the single
inter-node block arrives only after a whole node's worth of compute could have run, and half of the compute
comes after it.  Splitting the call by heads (attention is independent per head; a GQA group's query heads go
with their K/V head) turns each of those exposed transfers into ``1/G`` of its size:
:func:`run_pipelined` posts group ``g + 1``'s first transfer before group ``g``'s body runs, and waits for
group ``g``'s last hop after group ``g + 1``'s body.  On a link-bound ring the link then never idles between
groups, and the exposed part of the call falls from ``first + last transfer + last compute step`` to
``1/G`` of it.

Cost: ``G`` times the kernel calls (each on ``1/G`` of the heads) and messages, so groups are used only
where a step's message is large (:data:`MIN_GROUP_BYTES`).  Memory: two groups' buffers are alive at once
(group ``g``'s and the next one's first arrivals), so the loops' transient buffers scale by ``2/G``.
Score modifications are applied per head index (ALiBi slopes, a FlexAttention ``score_mod``), so a mask with
any runs as one group.

``BURSTC_RING_HEAD_GROUPS=n`` (or :func:`set_head_groups`) forces at most ``n`` groups (1: off) for
every call of the process, for benchmarks and tests.
"""
from __future__ import annotations

from typing import Callable, Generator, Sequence

import torch
from torch import Tensor

from burstc.ops.batch_groups import place_rows_
from burstc.ops.split_limit import SplitLimit

MAX_HEAD_GROUPS = 4
# a step's K/V message below this per group is not split: a message and a kernel call per group cost more
# than the fraction of a small transfer they could hide
MIN_GROUP_BYTES = 1 << 20

_LIMIT = SplitLimit("BURSTC_RING_HEAD_GROUPS", "head groups")
set_head_groups = _LIMIT.set  # at most n head groups per ring call (1: the unsplit loop); None: automatic
head_groups_forced = _LIMIT.forced


def head_group_count(heads_kv: int, kv_step_bytes: int, world_size: int, score_mods: bool) -> int:
    """How many head groups a ring call runs as: a divisor of ``heads_kv``; 1 on one rank or with score
    modifications.  Automatic: the most (up to :data:`MAX_HEAD_GROUPS`) whose share of a step's K/V message
    (``kv_step_bytes``: the local shard's K and V) is at least :data:`MIN_GROUP_BYTES`."""
    if world_size < 2 or score_mods or heads_kv < 2:
        return 1
    requested = _LIMIT.requested()
    if requested is None:
        limit = min(MAX_HEAD_GROUPS, kv_step_bytes // MIN_GROUP_BYTES)
    else:
        limit = requested
    return max(d for d in range(1, heads_kv + 1) if heads_kv % d == 0 and d <= max(1, limit))


def shard_head_groups(batch: int, heads_kv: int, local_len: int, head_dim: int, dtype: torch.dtype | int,
                      world_size: int, score_mods: bool) -> int:
    """:func:`head_group_count` of a ring call on shards of this shape (``dtype``: a torch dtype or an element
    size): a step's message is the local shard's K and V."""
    from burstc.planner import element_size

    kv_step_bytes = 2 * batch * heads_kv * local_len * head_dim * element_size(dtype)
    return head_group_count(heads_kv, kv_step_bytes, world_size, score_mods)


def head_slices(heads_q: int, heads_kv: int, groups: int) -> list[tuple[slice, slice]]:
    """``(query heads, key/value heads)`` of each group: contiguous K/V heads, with the query heads that
    read them (query head ``h`` reads K/V head ``h // (heads_q / heads_kv)``, SDPA's ``enable_gqa``)."""
    per_kv, ratio = heads_kv // groups, heads_q // heads_kv
    return [(slice(g * per_kv * ratio, (g + 1) * per_kv * ratio), slice(g * per_kv, (g + 1) * per_kv))
            for g in range(groups)]


def call_head_slices(q_BHSD: Tensor, k_BHSD: Tensor, world_size: int, score_mods: bool) -> list[tuple[slice, slice]]:
    """:func:`head_slices` of a ring call on these shards."""
    groups = shard_head_groups(*k_BHSD.shape, k_BHSD.element_size(), world_size, score_mods)
    return head_slices(q_BHSD.shape[1], k_BHSD.shape[1], groups)


# A group's loop is a generator with three parts, each ended by a ``yield`` but the last, which returns the
# group's result: (1) set up and post the first transfer; (2) the body, through posting the last hop;
# (3) wait for the last hop and finish.
GroupLoop = Generator[None, None, tuple]


def run_pipelined(loops: Sequence[GroupLoop], outputs: Sequence[Tensor] | None, slices: Sequence[Sequence[slice]],
                  batch_rows: Sequence | None = None) -> tuple[Tensor, ...]:
    """Run a call's loops (one per head group of each batch group) in order, each loop's first transfer posted
    before the previous loop's body and its last hop waited for after the next loop's body.  ``outputs``: whole
    tensors each loop's results are copied into as it finishes (``results[i]`` into heads ``slices[g][i]`` and
    batch rows ``batch_rows[g]`` of ``outputs[i]``), so a loop's result is freed at once; a single loop's
    results are returned as they are (``outputs`` None).  ``batch_rows``: each loop's batch rows of the outputs
    (a slice or an index, :mod:`burstc.ops.batch_groups`), None for all."""
    return start_pipelined(loops, outputs, slices, batch_rows)()


def start_pipelined(loops: Sequence[GroupLoop], outputs: Sequence[Tensor] | None, slices: Sequence[Sequence[slice]],
                    batch_rows: Sequence | None = None) -> Callable[[], tuple[Tensor, ...]]:
    """:func:`run_pipelined` up to the last loop's third part (waiting for its last hop), which the returned
    function runs and then returns the results: what the caller runs in between overlaps the last hop."""
    parts_run, finished = [0] * len(loops), [False] * len(loops)
    single: list[tuple] = []

    def advance(group: int) -> None:
        parts_run[group] += 1
        try:
            next(loops[group])
        except StopIteration as stop:
            if parts_run[group] != 3:
                raise AssertionError(f"head group {group}'s ring loop ended after {parts_run[group]} of its "
                                     "three parts") from None
            finished[group] = True
            if outputs is None:
                single.append(stop.value)
                return
            rows = slice(None) if batch_rows is None else batch_rows[group]
            for output, part, heads in zip(outputs, stop.value, slices[group]):
                place_rows_(output, rows, heads, part)

    advance(0)
    for group in range(len(loops)):
        if group + 1 < len(loops):
            advance(group + 1)  # its first transfer goes out behind this group's body
        advance(group)
        if group > 0:
            advance(group - 1)  # its last hop travelled during this group's body

    def finish() -> tuple[Tensor, ...]:
        advance(len(loops) - 1)
        if not all(finished):
            raise AssertionError(f"a head group's ring loop did not end after its three parts: ended {finished}")
        return tuple(single[0]) if outputs is None else tuple(outputs)

    return finish
