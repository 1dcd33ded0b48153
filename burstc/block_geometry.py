"""Block geometry: which parts of a (query shard, key/value shard) pair a mask leaves to compute.

:func:`blocks` is the one answer for the ring op, its work counters and the benchmarks' work balance:
a tuple of :class:`Block` sub-rectangles of the pair, each computed by one dense or top-left-causal
kernel call, whose union is exactly the visible (query, key) entries of the pair.  The empty tuple
means the mask hides the whole pair (skip its compute and, later, its transfer).

Local order is increasing global order (:func:`burstc.layout.local_positions`), so a causal mask
between two shards of the same rank is the plain local causal mask.
"""
from __future__ import annotations

import dataclasses

from burstc.attention_ir import MaskSpec
from burstc.layout import check_layout

FULL = "full"
CAUSAL = "causal"  # top-left aligned on the block: block row i sees block keys 0..i
BLOCK_MASKS = (FULL, CAUSAL)


@dataclasses.dataclass(frozen=True)
class Block:
    """Attention of query rows ``[q_start, q_stop)`` against key rows ``[kv_start, kv_stop)`` of the
    two shards, with the block's own ``mask`` (:data:`FULL` or top-left :data:`CAUSAL`)."""

    q_start: int
    q_stop: int
    kv_start: int
    kv_stop: int
    mask: str = FULL

    def __post_init__(self):
        if self.mask not in BLOCK_MASKS:
            raise ValueError(f"block mask must be one of {BLOCK_MASKS}, got {self.mask!r}")

    @property
    def causal(self) -> bool:
        return self.mask == CAUSAL

    @property
    def q_rows(self) -> slice:
        return slice(self.q_start, self.q_stop)

    @property
    def kv_rows(self) -> slice:
        return slice(self.kv_start, self.kv_stop)

    @property
    def score_entries(self) -> int:
        """Unmasked (query, key) pairs of the block (top-left causal: row i sees i + 1 keys)."""
        rows, cols = self.q_stop - self.q_start, self.kv_stop - self.kv_start
        if not self.causal:
            return rows * cols
        triangle = min(rows, cols)
        return triangle * (triangle + 1) // 2 + (rows - triangle) * cols


def check_executable(mask: MaskSpec) -> MaskSpec:
    """``mask`` if the ring executes it today (full or causal), else ``NotImplementedError`` naming it."""
    if not (mask.is_full or mask.is_causal):
        raise NotImplementedError(f"ring attention executes only full and causal masks, not {mask.encode()!r}")
    return mask


def blocks(layout: str, mask: MaskSpec, q_owner: int, kv_owner: int, local_len: int, world_size: int
           ) -> tuple[Block, ...]:
    """The blocks of (queries of rank ``q_owner``) x (keys of rank ``kv_owner``) that ``mask`` leaves,
    on ``world_size`` ranks holding ``local_len`` tokens each in ``layout`` order."""
    check_layout(layout)
    check_executable(mask)
    if not (0 <= q_owner < world_size and 0 <= kv_owner < world_size):
        raise ValueError(f"owners ({q_owner}, {kv_owner}) outside [0, {world_size})")
    if local_len < 1 or (layout == "zigzag" and local_len % 2):
        raise ValueError(f"layout {layout!r} cannot hold {local_len} tokens per rank")
    s = local_len
    if mask.is_full:
        return (Block(0, s, 0, s),)
    if q_owner == kv_owner:
        return (Block(0, s, 0, s, CAUSAL),)
    if layout == "zigzag":
        # Rank r holds chunks r (head) and 2P-1-r (tail), s/2 tokens each.  An earlier rank's
        # head precedes all our queries and its tail follows them: all q x first half of kv.  A
        # later rank's chunks both follow our head and precede our tail: second half of q x all kv.
        half = s // 2
        return (Block(0, s, 0, half),) if kv_owner < q_owner else (Block(half, s, 0, s),)
    if layout == "striped":
        # Query i is global i*P + q_owner, key j is j*P + kv_owner.  kv_owner < q_owner: j <= i
        # (causal).  kv_owner > q_owner: j < i, i.e. causal on (q[1:], k[:-1]).
        if kv_owner < q_owner:
            return (Block(0, s, 0, s, CAUSAL),)
        return (Block(1, s, 0, s - 1, CAUSAL),) if s > 1 else ()
    # contiguous: earlier shards are entirely visible, later ones entirely hidden
    return (Block(0, s, 0, s),) if kv_owner < q_owner else ()
