"""Block geometry: which parts of a (query shard, key/value shard) pair a mask leaves to compute.

:func:`blocks` is the one answer for the ring op, its work counters and the benchmarks' work balance:
a tuple of :class:`Block` sub-rectangles of the pair, each computed by one kernel call, that cover
every visible (query, key) entry of the pair exactly once.  A block is dense (:data:`FULL`),
top-left causal (:data:`CAUSAL`), or :data:`POSITIONS`: its rectangle holds hidden entries too, and
the kernel evaluates the mask element-wise from the global positions (window edges).  The empty
tuple means the mask hides the whole pair (skip its compute and, later, its transfer).

Executable masks (:func:`check_executable`): ``Causal`` and ``SlidingWindow`` terms, ``Alibi`` and
``SoftCap`` score mods, and the runtime terms ``Documents`` and ``KeyPadding``.  :func:`blocks` is
the static geometry: it answers for ``MaskSpec.static_part`` (the ring op evaluates the runtime
terms element-wise inside those blocks, from the data) and refuses a spec with runtime terms.  Full and causal keep their closed-form blocks; with a window, each query
row sees one interval of the pair's keys (global positions are increasing in local order), found by
binary search.  Rows seeing the same keys make full blocks; the stretches between them (a window's band) are
tiled, each tile a full block of the keys all its rows see plus its ragged edges (full, causal or anti-causal when
their intervals say so, else positions over their bounding box).  Without a window the own pair is one block covering
every query row (the ring's merge starts from it); with one, the merge starts from an empty accumulator.

Local order is increasing global order (:func:`burstc.layout.local_positions`), so a causal mask
between two shards of the same rank is the plain local causal mask.
"""
from __future__ import annotations

import dataclasses
import functools

import torch

from burstc.attention_ir import (RUNTIME_TERMS, STATIC_SCORE_MODS, STATIC_TERMS, Causal, Documents, KeyPadding, MaskSpec,
                                 SlidingWindow)
from burstc.layout import ChunkLayout, check_layout, local_positions

FULL = "full"
CAUSAL = "causal"  # top-left aligned on the block: block row i sees block keys 0..i
ANTI_CAUSAL = "anti_causal"  # a square block whose row i sees block keys i..end (a window's trailing edge)
POSITIONS = "positions"  # element-wise mask from the block's global positions
BLOCK_MASKS = (FULL, CAUSAL, ANTI_CAUSAL, POSITIONS)


@dataclasses.dataclass(frozen=True)
class Block:
    """Attention of query rows ``[q_start, q_stop)`` against key rows ``[kv_start, kv_stop)`` of the
    two shards, with the block's own ``mask`` (:data:`FULL`, top-left :data:`CAUSAL`, or
    :data:`POSITIONS` with ``visible_entries``, its count of visible entries)."""

    q_start: int
    q_stop: int
    kv_start: int
    kv_stop: int
    mask: str = FULL
    visible_entries: int | None = None  # POSITIONS blocks only
    data_free: bool = False  # the call's runtime data hide nothing inside: the static kernel serves it

    def __post_init__(self):
        if self.mask not in BLOCK_MASKS:
            raise ValueError(f"block mask must be one of {BLOCK_MASKS}, got {self.mask!r}")
        if (self.mask == POSITIONS) != (self.visible_entries is not None):
            raise ValueError(f"visible_entries is given exactly for {POSITIONS!r} blocks, got {self}")

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
    def kernel_entries(self) -> int:
        """Entries the kernel evaluates: the rectangle of a :data:`POSITIONS` block (masked element-wise), else
        :attr:`score_entries` (full, and the causal kernel's triangle)."""
        if self.mask == POSITIONS:
            return (self.q_stop - self.q_start) * (self.kv_stop - self.kv_start)
        return self.score_entries

    @property
    def score_entries(self) -> int:
        """Unmasked (query, key) pairs of the block (top-left causal: row i sees i + 1 keys)."""
        if self.visible_entries is not None:
            return self.visible_entries
        rows, cols = self.q_stop - self.q_start, self.kv_stop - self.kv_start
        if self.mask == ANTI_CAUSAL:
            return rows * (rows + 1) // 2
        if not self.causal:
            return rows * cols
        triangle = min(rows, cols)
        return triangle * (triangle + 1) // 2 + (rows - triangle) * cols


def check_executable(mask: MaskSpec) -> MaskSpec:
    """``mask`` if the ring executes it (static terms, documents and key padding, as
    :attr:`MaskSpec.ring_supported` says), else ``NotImplementedError`` naming what it lacks."""
    if not mask.ring_supported:
        executed = STATIC_TERMS + STATIC_SCORE_MODS + RUNTIME_TERMS
        missing = [t for t in (*mask.terms, *mask.score_mods) if not isinstance(t, executed)]
        raise NotImplementedError(
            f"ring attention executes static masks only (causal, sliding window, ALiBi, soft-cap) and documents "
            f"and key padding from their data, not {mask.encode()!r}: {', '.join(t.encode() for t in missing)} "
            f"needs runtime data or a subgraph it does not take")
    return mask


def blocks(layout: str, mask: MaskSpec, q_owner: int, kv_owner: int, local_len: int, world_size: int
           ) -> tuple[Block, ...]:
    """The blocks of (queries of rank ``q_owner``) x (keys of rank ``kv_owner``) that ``mask`` leaves,
    on ``world_size`` ranks holding ``local_len`` tokens each in ``layout`` order."""
    check_layout(layout)
    check_executable(mask)
    if mask.runtime_terms:
        raise NotImplementedError(
            f"blocks() is the static geometry, {mask.encode()!r} has runtime terms: ask for its static_part "
            f"and evaluate {', '.join(t.encode() for t in mask.runtime_terms)} element-wise from the data")
    if not (0 <= q_owner < world_size and 0 <= kv_owner < world_size):
        raise ValueError(f"owners ({q_owner}, {kv_owner}) outside [0, {world_size})")
    if local_len < 1 or (layout == "zigzag" and local_len % 2):
        raise ValueError(f"layout {layout!r} cannot hold {local_len} tokens per rank")
    s = local_len
    if mask.term(SlidingWindow) is not None or (isinstance(layout, ChunkLayout) and Causal() in mask.terms
                                                and q_owner != kv_owner):
        # a chunk layout's causal pairs have no closed form: each row's keys are one interval all the same
        return _window_blocks(layout, mask.terms, q_owner, kv_owner, local_len, world_size)
    if Causal() not in mask.terms:
        return (Block(0, s, 0, s),)
    if q_owner == kv_owner:  # causal (score mods don't change the geometry)
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


def visible_intervals(q_positions: torch.Tensor, kv_positions: torch.Tensor, mask: MaskSpec
                      ) -> tuple[torch.Tensor, torch.Tensor]:
    """``(lo, hi)``: query row ``i`` sees exactly the keys ``lo[i] <= j < hi[i]`` (empty when
    ``lo >= hi``) under the static terms of ``mask``; both positions increasing."""
    window = mask.term(SlidingWindow) or SlidingWindow(None, None)
    first = q_positions - window.left if window.left is not None else torch.full_like(q_positions, -1)
    last = q_positions + window.right if window.right is not None else torch.full_like(q_positions, kv_positions.max())
    if Causal() in mask.terms:
        last = torch.minimum(last, q_positions)
    lo = torch.searchsorted(kv_positions, first)
    hi = torch.searchsorted(kv_positions, last, right=True)
    return lo, torch.maximum(hi, lo)


@functools.lru_cache(maxsize=4096)
def _window_blocks(layout: str, terms: tuple, q_owner: int, kv_owner: int, local_len: int, world_size: int
                   ) -> tuple[Block, ...]:
    """The pair's blocks under a window (cached: the op asks every step): runs of rows seeing the same keys make
    a full block, the rows between them (a band) tiles (:func:`_tiled_blocks`)."""
    seq_len = local_len * world_size
    lo, hi = visible_intervals(local_positions(seq_len, world_size, q_owner, layout),
                               local_positions(seq_len, world_size, kv_owner, layout), MaskSpec(terms))
    change = torch.ones(local_len, dtype=torch.bool)
    change[1:] = (lo[1:] != lo[:-1]) | (hi[1:] != hi[:-1])
    starts = change.nonzero().flatten().tolist() + [local_len]
    seen_rows = (hi > lo).tolist()
    found, pending = [], None  # pending: first row of the stretch not yet in a block
    for start, stop in zip(starts, starts[1:]):
        seen = seen_rows[start]
        if seen and stop - start == 1:
            pending = start if pending is None else pending
            continue
        if pending is not None:
            found.extend(_tiled_blocks(pending, start, lo, hi))
            pending = None
        if seen:
            found.append(Block(start, stop, int(lo[start]), int(hi[start])))
    if pending is not None:
        found.extend(_tiled_blocks(pending, local_len, lo, hi))
    return tuple(found)


WINDOW_TILE_ROWS = 128
"""The fewest rows per tile of a window's band (:func:`_tiled_blocks`; tiles are half the band's typical width when
that is more): its middle runs the full kernel, its edges the causal and (reversed) anti-causal ones."""


def _tiled_blocks(q_start: int, q_stop: int, lo: torch.Tensor, hi: torch.Tensor) -> list[Block]:
    """Rows ``[q_start, q_stop)`` (each seeing keys ``[lo, hi)``, the intervals changing row by row: a window's
    band) as tiles half the band's typical width tall (at least :data:`WINDOW_TILE_ROWS` rows).  A tile whose rows
    share keys splits into the keys all its rows see (a full block) and the ragged parts before and after (a
    sliding window's: an anti-causal and a causal triangle, :func:`_rows_block` classifies them); the three parts are
    disjoint in keys and cover each row's interval exactly.  A small tile, or one without shared keys, is one block
    over its rows' bounding box.  Stretches and tiles that are already one full or causal block stay one."""
    whole = _rows_block(q_start, q_stop, lo, hi)
    if whole.mask != POSITIONS:
        return [whole]
    # tiles half a typical interval tall (at least WINDOW_TILE_ROWS): the shared part stays wide, the calls few
    widths = (hi - lo)[q_start:q_stop]
    tile_rows = max(WINDOW_TILE_ROWS, int(widths[widths > 0].median()) // 2) if bool((widths > 0).any()) \
        else WINDOW_TILE_ROWS
    found = []
    for start in range(q_start, q_stop, tile_rows):
        stop = min(start + tile_rows, q_stop)
        tile_lo, tile_hi = lo[start:stop], hi[start:stop]
        seen = tile_hi > tile_lo
        if not bool(seen.any()):
            continue
        shared_lo, shared_hi = int(tile_lo[seen].max()), int(tile_hi[seen].min())
        tile = _rows_block(start, stop, lo, hi)
        small = tile.kernel_entries <= MERGE_SLACK_ENTRIES  # a kernel call's fixed cost: one call is cheaper
        if small or not bool(seen.all()) or shared_lo >= shared_hi or tile.mask != POSITIONS:
            found.append(tile)
            continue
        found.append(Block(start, stop, shared_lo, shared_hi))
        for part_lo, part_hi in ((tile_lo, tile_hi.clamp(max=shared_lo)), (tile_lo.clamp(min=shared_hi), tile_hi)):
            rows = (part_hi > part_lo).nonzero().flatten()
            if rows.numel():
                first, last = int(rows[0]), int(rows[-1]) + 1
                clipped_lo, clipped_hi = lo.clone(), hi.clone()
                clipped_lo[start:stop], clipped_hi[start:stop] = part_lo, torch.maximum(part_hi, part_lo)
                found.append(_rows_block(start + first, start + last, clipped_lo, clipped_hi))
    return found


def _rows_block(q_start: int, q_stop: int, lo: torch.Tensor, hi: torch.Tensor) -> Block:
    """One block for rows ``[q_start, q_stop)`` (each seeing keys ``[lo, hi)``, some row seeing any):
    full or top-left causal when the intervals are, else positions over their bounding box."""
    lo, hi = lo[q_start:q_stop], hi[q_start:q_stop]
    counts = hi - lo
    kv_start, kv_stop = int(lo[counts > 0].min()), int(hi.max())
    if bool((lo == kv_start).all()):
        if bool((hi == kv_stop).all()):
            return Block(q_start, q_stop, kv_start, kv_stop)
        triangle = torch.arange(1, q_stop - q_start + 1).clamp(max=kv_stop - kv_start)
        if torch.equal(counts, triangle):
            return Block(q_start, q_stop, kv_start, kv_stop, CAUSAL)
    rows = q_stop - q_start
    if rows == kv_stop - kv_start and bool((hi == kv_stop).all()) and torch.equal(lo - kv_start, torch.arange(rows)):
        return Block(q_start, q_stop, kv_start, kv_stop, ANTI_CAUSAL)
    return Block(q_start, q_stop, kv_start, kv_stop, POSITIONS, int(counts.sum()))


def clip_query_rows(found: tuple[Block, ...], query_rows: int, positions=None) -> tuple[Block, ...]:
    """The part of a pair's blocks on query rows ``[0, query_rows)``: what a forward restricted to a shard's first
    rows computes (a checkpoint's recompute of the rows it did not keep).  A full block keeps its keys; a top-left
    causal one keeps the keys its remaining rows see; an anti-causal or positions block keeps its keys and runs the
    position-masked kernel, its visible entries recounted on the remaining rows (``positions() -> (q positions,
    kv positions, static mask)`` of the pair, asked only then)."""
    clipped = []
    for block in found:
        if block.q_stop <= query_rows:
            clipped.append(block)
            continue
        rows = query_rows - block.q_start
        if rows <= 0:
            continue
        if block.mask == FULL:
            clipped.append(dataclasses.replace(block, q_stop=query_rows))
        elif block.mask == CAUSAL:  # row i sees keys 0..i: the first ``rows`` rows see min(rows, width) keys
            width = min(rows, block.kv_stop - block.kv_start)
            clipped.append(dataclasses.replace(block, q_stop=query_rows, kv_stop=block.kv_start + width))
        else:
            q_pos, kv_pos, static = positions()
            visible = int(static.visible(q_pos[block.q_start:query_rows], kv_pos[block.kv_rows]).sum())
            if visible:
                clipped.append(dataclasses.replace(block, q_stop=query_rows, mask=POSITIONS, visible_entries=visible))
    return tuple(clipped)


# ---------------------------------------------------------------------------------------------
# Which rows of a pair travel: the mask-aware transfers

Runs = tuple[tuple[int, int], ...]
"""Disjoint, increasing ``(start, stop)`` row ranges of one shard (local order)."""


def runs_length(runs: Runs) -> int:
    return sum(stop - start for start, stop in runs)


def _runs_of(flags: torch.Tensor) -> Runs:
    """The runs of True in a 1-D bool tensor."""
    if not bool(flags.any()):
        return ()
    padded = torch.cat([flags.new_zeros(1), flags, flags.new_zeros(1)]).to(torch.int8)
    edges = (padded[1:] - padded[:-1]).nonzero().flatten().tolist()
    return tuple(zip(edges[0::2], edges[1::2]))


def union_runs(all_runs) -> Runs:
    """The rows in any of ``all_runs`` (each sorted, disjoint runs), as sorted disjoint runs."""
    merged: list[list[int]] = []
    for start, stop in sorted(run for runs in all_runs for run in runs):
        if merged and start <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], stop)
        else:
            merged.append([start, stop])
    return tuple((start, stop) for start, stop in merged)


@functools.lru_cache(maxsize=16384)
def _pair_rows_seen(layout: str, terms: tuple, q_owner: int, kv_owner: int, local_len: int, world_size: int
                    ) -> tuple[Runs, Runs]:
    """``(query rows that see some key, key rows some query sees)`` of the pair under the static
    ``terms`` (cached: the op, the planner and the simulator ask for every pair)."""
    everything = ((0, local_len),)
    mask = MaskSpec(terms)
    if not mask.terms:  # full attention: every row of every pair
        return everything, everything
    if mask.term(SlidingWindow) is None and not isinstance(layout, ChunkLayout):
        # causal on a static layout: closed-form blocks, each seeing all its rows and keys
        return _block_rows_seen(blocks(layout, mask, q_owner, kv_owner, local_len, world_size))
    seq_len = local_len * world_size
    lo, hi = visible_intervals(local_positions(seq_len, world_size, q_owner, layout),
                               local_positions(seq_len, world_size, kv_owner, layout), mask)
    seen = hi > lo
    # keys seen: the union of the rows' intervals, by a difference array over the key rows
    cover = torch.zeros(local_len + 1, dtype=torch.int64)
    cover.index_add_(0, lo[seen], torch.ones(int(seen.sum()), dtype=torch.int64))
    cover.index_add_(0, hi[seen], torch.full((int(seen.sum()),), -1, dtype=torch.int64))
    return _runs_of(seen), _runs_of(cover.cumsum(0)[:local_len] > 0)


def _block_rows_seen(found: tuple[Block, ...]) -> tuple[Runs, Runs]:
    """``_pair_rows_seen`` from closed-form blocks (full, or top-left causal at least as tall as wide): every
    row of such a block sees a key and every key is seen, so the runs are the unions of their row ranges
    (O(blocks), where the interval search is O(local_len) tensor work per pair: minutes over P^2 pairs at
    S = 1M)."""
    assert all(b.mask == FULL or (b.mask == CAUSAL and b.q_stop - b.q_start >= b.kv_stop - b.kv_start)
               for b in found), found
    return (union_runs([((b.q_start, b.q_stop),) for b in found if b.q_stop > b.q_start]),
            union_runs([((b.kv_start, b.kv_stop),) for b in found if b.kv_stop > b.kv_start]))


def travelling_rows(queries_travel: bool, layout: str, mask: MaskSpec, receiver: int, sender: int, local_len: int,
                    world_size: int, hidden_pairs: frozenset = frozenset()) -> Runs:
    """The rows of ``sender``'s travelling side that ``receiver`` needs, under the static part of
    ``mask``: its key/value rows some query of ``receiver`` sees (K/V travel: the forward and the
    ``kv_ring`` backward), or its query rows that see some key of ``receiver`` (queries travel: the
    ``burst`` backward).  The gradient of these rows returns from ``receiver`` to ``sender``.  Empty
    when the pair is hidden.  A pure function of its arguments: every rank derives the same transfers,
    so both sides of a pair always agree on what is sent and what is skipped.  Runtime terms
    (documents, padding) are data: the static part's rows travel (a superset), except for the
    ``(q_owner, kv_owner)`` pairs in ``hidden_pairs`` (:func:`pairs_hidden_by_data`), which move nothing."""
    check_layout(layout)
    terms = mask.static_part.terms
    if ((sender, receiver) if queries_travel else (receiver, sender)) in hidden_pairs:
        return ()
    if queries_travel:
        return _pair_rows_seen(layout, terms, sender, receiver, local_len, world_size)[0]
    return _pair_rows_seen(layout, terms, receiver, sender, local_len, world_size)[1]


def clip_pair_to_rows(found: tuple[Block, ...], query_rows: int, layout, mask: MaskSpec, q_owner: int, kv_owner: int,
                      local_len: int, world_size: int) -> tuple[Block, ...]:
    """:func:`clip_query_rows` of the pair ``(q_owner, kv_owner)``'s blocks ``found``, its positions from the layout."""
    seq_len = local_len * world_size
    return clip_query_rows(found, query_rows, lambda: (
        local_positions(seq_len, world_size, q_owner, layout), local_positions(seq_len, world_size, kv_owner, layout),
        mask.static_part))


def keys_of(found: tuple[Block, ...]) -> Runs:
    """The key rows the blocks read (the union of their key ranges)."""
    return union_runs([((b.kv_start, b.kv_stop),) for b in found])


def first_rows_key_rows(layout: str, mask: MaskSpec, query_rows: int, receiver: int, sender: int, local_len: int,
                        world_size: int) -> Runs:
    """The key rows of ``sender`` that ``receiver``'s first ``query_rows`` query rows see (the static part of
    ``mask``): what a forward restricted to those rows moves (the union of :func:`clip_query_rows`'s keys)."""
    return keys_of(clip_pair_to_rows(blocks(layout, mask.static_part, receiver, sender, local_len, world_size),
                                     query_rows, layout, mask, receiver, sender, local_len, world_size))


def intersect_runs(a: Runs, b: Runs) -> Runs:
    """The rows in both ``a`` and ``b`` (each sorted, disjoint runs), as sorted disjoint runs."""
    found, j = [], 0
    for start, stop in a:
        while j < len(b) and b[j][1] <= start:
            j += 1
        k = j
        while k < len(b) and b[k][0] < stop:
            lo, hi = max(start, b[k][0]), min(stop, b[k][1])
            if lo < hi:
                found.append((lo, hi))
            k += 1
    return tuple(found)


def key_validity(layout, owner: int, local_len: int, world_size: int,
                 key_valid_BS: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Bool ``[local_len]`` twice: the rows of ``owner``'s shard that are a real key in some batch row
    (``key_valid_BS`` ``[B, S_global]``; a row that is padding in every batch row is a key no query sees), and in
    every batch row."""
    positions = local_positions(local_len * world_size, world_size, owner, layout, key_valid_BS.device)
    valid_BL = key_valid_BS[:, positions]
    return valid_BL.any(0), valid_BL.all(0)


def valid_key_rows(layout, owner: int, local_len: int, world_size: int, key_valid_BS: torch.Tensor) -> torch.Tensor:
    """The first of :func:`key_validity`: the rows of ``owner``'s shard that are a real key in some batch row."""
    return key_validity(layout, owner, local_len, world_size, key_valid_BS)[0]


def valid_key_runs(layout, owner: int, local_len: int, world_size: int, key_valid_BS: torch.Tensor) -> Runs:
    """:func:`valid_key_rows` as runs: the rows of ``owner``'s shard that need travel at all."""
    return _runs_of(valid_key_rows(layout, owner, local_len, world_size, key_valid_BS).cpu())


def data_hides_pair(layout: str, mask: MaskSpec, q_owner: int, kv_owner: int, local_len: int, world_size: int,
                    doc_ids_BS: torch.Tensor | None = None, key_valid_BS: torch.Tensor | None = None) -> bool:
    """Whether the runtime data (``[B, S_global]``, indexed by global position, the same on every rank)
    hide every entry of the pair in every batch row: disjoint document-id ranges (ids need not be
    sorted: disjoint ``[min, max]`` ranges never meet), or no valid key.  Exact for what it says,
    O(B * S_local); False for a static mask."""
    if not mask.runtime_terms:
        return False
    some_data_BS = doc_ids_BS if doc_ids_BS is not None else key_valid_BS
    seq_len, device = local_len * world_size, some_data_BS.device
    q_pos, kv_pos = (local_positions(seq_len, world_size, owner, layout, device) for owner in (q_owner, kv_owner))
    hidden_B = torch.zeros(some_data_BS.shape[0], dtype=torch.bool, device=device)
    if mask.term(Documents) is not None:
        q_docs, kv_docs = doc_ids_BS[:, q_pos], doc_ids_BS[:, kv_pos]
        hidden_B = hidden_B | (q_docs.amax(1) < kv_docs.amin(1)) | (kv_docs.amax(1) < q_docs.amin(1))
    if mask.term(KeyPadding) is not None:
        hidden_B = hidden_B | ~key_valid_BS[:, kv_pos].any(1)
    return bool(hidden_B.all())


def pairs_hidden_by_data(layout: str, mask: MaskSpec, local_len: int, world_size: int,
                         doc_ids_BS: torch.Tensor | None = None, key_valid_BS: torch.Tensor | None = None,
                         rank: int | None = None) -> frozenset:
    """The ``(q_owner, kv_owner)`` pairs of different ranks that the static part of ``mask`` leaves some
    entry of but the data hide (:func:`data_hides_pair`): their rows need not travel.  Only the pairs
    involving ``rank`` when given (what that rank's transfers ask).  Every rank computes the same
    answer for a pair from the same replicated data, so both sides skip it together."""
    if not mask.runtime_terms:
        return frozenset()
    static, others = mask.static_part, range(world_size)
    candidates = {(q, kv) for q in others for kv in others if q != kv and rank in (None, q, kv)}
    return frozenset(pair for pair in candidates
                     if blocks(layout, static, *pair, local_len, world_size)
                     and data_hides_pair(layout, mask, *pair, local_len, world_size, doc_ids_BS, key_valid_BS))


# ---------------------------------------------------------------------------------------------
# Blocks trimmed by the documents of the call (runtime data)

MERGE_SLACK_ENTRIES = 128 * 128
"""Two neighbouring document blocks become one bounding block while that adds at most this many hidden entries:
about the work of one kernel call's fixed cost on a CPU core (128 x 128 scores at D = 128 is ~8 MFLOP, ~0.1 ms),
so packing many tiny documents does not turn into thousands of calls."""


def documents_sorted(doc_ids_BS: torch.Tensor) -> bool:
    """Are the ids nondecreasing along every batch row (packed documents, each one stretch)?  Then the keys a query
    shares a document with are one interval of any shard (positions increase in local order)."""
    return bool((doc_ids_BS[:, 1:] >= doc_ids_BS[:, :-1]).all())


def trim_blocks_to_documents(found: tuple[Block, ...], q_positions: torch.Tensor, kv_positions: torch.Tensor,
                             doc_ids_BS: torch.Tensor, key_valid_BS: torch.Tensor | None = None
                             ) -> tuple[Block, ...]:
    """``found`` (a pair's static blocks) cut down to the entries whose query and key share a document in some
    batch row, for sorted ids (:func:`documents_sorted`).  Each block's rows split where any batch row's document
    changes; a stretch keeps the keys of its documents (one interval per batch row; their union's bounding range),
    a stretch with none is dropped, and small neighbouring stretches merge while :data:`MERGE_SLACK_ENTRIES` allows.
    A box inside one document in every batch row (and, with ``key_valid_BS``, whose keys are all valid) keeps its
    static block's kernel (:func:`_static_pieces`: full and causal blocks run the flash-style kernels, marked
    ``data_free``); any other box is a :data:`POSITIONS` block (the kernel applies the static terms and the data
    element-wise; ``visible_entries`` is its rectangle, an upper bound: the work counters count the data's visible
    entries).  Every visible entry of ``found`` stays covered exactly once."""
    q_docs_BL, kv_docs_BL = doc_ids_BS[:, q_positions], doc_ids_BS[:, kv_positions]
    kv_valid_BL = None if key_valid_BS is None else key_valid_BS[:, kv_positions]
    trimmed = []
    for block in found:
        if block.q_stop <= block.q_start or block.kv_stop <= block.kv_start:
            continue
        rows_BR = q_docs_BL[:, block.q_rows]
        keys_BK = kv_docs_BL[:, block.kv_rows].contiguous()
        change = torch.zeros(rows_BR.shape[1], dtype=torch.bool)
        change[0] = True
        change[1:] = (rows_BR[:, 1:] != rows_BR[:, :-1]).any(0)
        starts = change.nonzero().flatten()
        stretch_docs_BT = rows_BR[:, starts].contiguous()
        lo_BT = torch.searchsorted(keys_BK, stretch_docs_BT)
        hi_BT = torch.searchsorted(keys_BK, stretch_docs_BT, right=True)
        seen_BT = hi_BT > lo_BT
        kv_lo = torch.where(seen_BT, lo_BT, keys_BK.shape[1]).amin(0).tolist()
        kv_hi = torch.where(seen_BT, hi_BT, 0).amax(0).tolist()
        bounds = starts.tolist() + [rows_BR.shape[1]]
        boxes = [(bounds[t], bounds[t + 1], kv_lo[t], kv_hi[t]) for t in range(len(kv_lo)) if kv_hi[t] > kv_lo[t]]
        for q0, q1, k0, k1 in _merged_boxes(boxes):
            q_docs_BR, kv_docs_BK = rows_BR[:, q0:q1], keys_BK[:, k0:k1]
            one_document = bool((q_docs_BR == q_docs_BR[:, :1]).all() and (kv_docs_BK == q_docs_BR[:, :1]).all())
            valid = kv_valid_BL is None or bool(kv_valid_BL[:, block.kv_start + k0:block.kv_start + k1].all())
            if one_document and valid and block.mask in (FULL, CAUSAL):
                trimmed.extend(_static_pieces(block, q0, q1, k0, k1))
            else:
                trimmed.append(Block(block.q_start + q0, block.q_start + q1, block.kv_start + k0, block.kv_start + k1,
                                     POSITIONS, (q1 - q0) * (k1 - k0)))
    return tuple(trimmed)


def _static_pieces(block: Block, q0: int, q1: int, k0: int, k1: int) -> list[Block]:
    """Box ``[q0, q1) x [k0, k1)`` (relative to ``block``, a full or top-left causal block) as full / top-left causal
    blocks marked ``data_free``.  In a causal block, row r sees keys up to r: keys before the box's first row are
    seen by all its rows (full), the keys from there on form a top-left causal block (rows before the first key
    see none of them)."""
    at = lambda q_start, q_stop, kv_start, kv_stop, kind: Block(  # noqa: E731
        block.q_start + q_start, block.q_start + q_stop, block.kv_start + kv_start, block.kv_start + kv_stop, kind,
        data_free=True)
    if block.mask == FULL:
        return [at(q0, q1, k0, k1, FULL)]
    pieces = []
    if k0 < min(q0, k1):
        pieces.append(at(q0, q1, k0, min(q0, k1), FULL))
    start, stop = max(q0, k0), min(k1, q1)
    if start < stop:
        pieces.append(at(start, q1, start, stop, CAUSAL))
    return pieces


MAX_PADDING_SEGMENTS = 5
"""A block's keys split at padding into at most this many runs (left or right padding of a batch: two or three);
keys padded in a scattered pattern keep the block whole, on the position-masked kernel."""


def split_blocks_at_key_padding(found: tuple[Block, ...], kv_valid_somewhere_L: torch.Tensor,
                                kv_valid_everywhere_L: torch.Tensor) -> tuple[Block, ...]:
    """A key-padding mask's blocks (no documents) with each full or top-left causal block's keys cut into runs:
    keys real in every batch row keep the static kernel (:func:`_static_pieces`, ``data_free``: the flash-style
    kernels), keys real in some rows only become a :data:`POSITIONS` block (the padding applied element-wise; for a
    causal block, only the rows from the run's first key on, the earlier ones see none of it), keys padded in every
    row are dropped (they do not travel).  Without this every block of a padded batch ran the position-masked
    kernel, which on CPU costs more than the transfers the padding saves.  Every visible entry stays covered
    exactly once; other blocks (windows' bands, anti-causal pieces) are kept as they are."""
    kinds_L = kv_valid_somewhere_L.to(torch.int8) + kv_valid_everywhere_L.to(torch.int8)  # 0 none, 1 some, 2 all
    split = []
    for block in found:
        if block.mask not in (FULL, CAUSAL):
            split.append(block)
            continue
        kinds = kinds_L[block.kv_start:block.kv_stop]
        edges = [0] + ((kinds[1:] != kinds[:-1]).nonzero().flatten() + 1).tolist() + [len(kinds)]
        if len(edges) - 1 > MAX_PADDING_SEGMENTS:
            split.append(block)
            continue
        rows = block.q_stop - block.q_start
        for k0, k1 in zip(edges[:-1], edges[1:]):
            kind = int(kinds[k0])
            if kind == 2:
                split.extend(_static_pieces(block, 0, rows, k0, k1))
            elif kind == 1:
                q0 = min(k0, rows) if block.mask == CAUSAL else 0  # top-left causal: row r sees keys 0..r
                if q0 < rows:
                    split.append(Block(block.q_start + q0, block.q_stop, block.kv_start + k0, block.kv_start + k1,
                                       POSITIONS, (rows - q0) * (k1 - k0)))
    return tuple(split)


def data_blocks(layout, mask: MaskSpec, q_owner: int, kv_owner: int, local_len: int, world_size: int,
                doc_ids_BS: torch.Tensor | None = None, key_valid_BS: torch.Tensor | None = None,
                packed_documents: bool | None = None) -> tuple[Block, ...]:
    """The blocks the ring computes for a pair with this call's data: :func:`blocks` of the static part; none when
    the data hide the whole pair (:func:`data_hides_pair`); without those whose keys are padding in every batch row
    (they stay home, :func:`valid_key_runs`); with packed documents (``packed_documents``, default
    :func:`documents_sorted`), those blocks trimmed to the documents (:func:`trim_blocks_to_documents`)."""
    if not mask.runtime_terms:
        return blocks(layout, mask, q_owner, kv_owner, local_len, world_size)
    found = blocks(layout, mask.static_part, q_owner, kv_owner, local_len, world_size)
    if found and data_hides_pair(layout, mask, q_owner, kv_owner, local_len, world_size, doc_ids_BS, key_valid_BS):
        return ()
    if found and mask.term(KeyPadding) is not None:  # keys padded in every batch row don't travel: drop their blocks
        kv_valid_L, kv_valid_everywhere_L = key_validity(layout, kv_owner, local_len, world_size, key_valid_BS)
        found = tuple(b for b in found if bool(kv_valid_L[b.kv_start:b.kv_stop].any()))
        if found and mask.term(Documents) is None:
            found = split_blocks_at_key_padding(found, kv_valid_L, kv_valid_everywhere_L)
    if found and mask.term(Documents) is not None:
        if packed_documents is None:
            packed_documents = documents_sorted(doc_ids_BS)
        if packed_documents:
            seq_len, device = local_len * world_size, doc_ids_BS.device
            found = trim_blocks_to_documents(found, local_positions(seq_len, world_size, q_owner, layout, device),
                                             local_positions(seq_len, world_size, kv_owner, layout, device),
                                             doc_ids_BS, key_valid_BS)
    return found


def document_travelling_rows(queries_travel: bool, layout, mask: MaskSpec, receiver: int, sender: int,
                             local_len: int, world_size: int, hidden_pairs: frozenset, blocks_of) -> Runs:
    """:func:`travelling_rows` for packed documents: of a pair the data leave some entry of, only the rows its
    trimmed blocks read (``blocks_of(q_owner, kv_owner)``: :func:`data_blocks` of the call), so a document edge
    sends only the rows of the documents that cross it.  Both sides derive them from the same replicated ids."""
    if not travelling_rows(queries_travel, layout, mask, receiver, sender, local_len, world_size, hidden_pairs):
        return ()
    q_owner, kv_owner = (sender, receiver) if queries_travel else (receiver, sender)
    found = blocks_of(q_owner, kv_owner)
    return union_runs([((b.q_start, b.q_stop),) if queries_travel else ((b.kv_start, b.kv_stop),) for b in found])


def _merged_boxes(boxes: list) -> list:
    """Neighbouring ``(q0, q1, k0, k1)`` boxes (rows increasing, disjoint) merged into their bounding box while the
    hidden entries that adds stay within :data:`MERGE_SLACK_ENTRIES`."""
    merged = []
    for box in boxes:
        if merged:
            q0, q1, k0, k1, area = merged[-1]
            nq0, nq1, nk0, nk1 = box
            lo, hi = min(k0, nk0), max(k1, nk1)
            new_area = area + (nq1 - nq0) * (nk1 - nk0)
            # small boxes only: a large one keeps its own (static, flash-style) kernel
            if (nq1 - q0) * (hi - lo) - new_area <= MERGE_SLACK_ENTRIES and new_area <= 4 * MERGE_SLACK_ENTRIES:
                merged[-1] = (q0, nq1, lo, hi, new_area)
                continue
        merged.append((*box, (box[1] - box[0]) * (box[3] - box[2])))
    return [box[:4] for box in merged]


@dataclasses.dataclass(frozen=True)
class GridPosition:
    """Rank ``rank`` of a nodes x ranks-per-node mesh in node-major sequence order (the double ring's geometry)."""

    nodes: int
    per_node: int
    rank: int

    def seq_rank(self, node_offset: int, local_offset: int) -> int:
        """The sequence rank of (this node + ``node_offset``, this local index + ``local_offset``)."""
        node, local = divmod(self.rank, self.per_node)
        return ((node + node_offset) % self.nodes) * self.per_node + (local + local_offset) % self.per_node


class DoubleRingRoutes:
    """Which rows of a travelling side move where on a double ring (:mod:`burstc.ops.double_ring`), for the
    rank at ``ring`` (a :class:`GridPosition` or the op's ring: ``rank``, ``per_node``, ``seq_rank``);
    ``rows_between(receiver=, sender=)`` is :func:`travelling_rows` of the call.  Pure functions, so both
    sides of every transfer, and the planner, agree."""

    def __init__(self, ring, rows_between):
        self.ring, self.rows_between = ring, rows_between

    def node_needs(self, node_offset: int, sender: int):
        """Rows of ``sender``'s travelling side that some rank of node (this + ``node_offset``) needs."""
        ring = self.ring
        return union_runs(self.rows_between(receiver=ring.seq_rank(node_offset, local), sender=sender)
                          for local in range(ring.per_node))

    def lane_out(self, lane: int):
        """Own rows sent over the inter-node link for outer step ``lane`` (to node + ``lane``)."""
        return self.node_needs(lane, self.ring.rank)

    def lane_in(self, lane: int):
        """Rows of lane block ``lane`` (rank (node - ``lane``, local)) this node needs."""
        return self.node_needs(0, self.ring.seq_rank(-lane, 0))

    def intra_out(self, lane: int, inner: int):
        """Rows of this rank's lane block ``lane`` that node-mate local + ``inner`` needs."""
        return self.rows_between(receiver=self.ring.seq_rank(0, inner), sender=self.ring.seq_rank(-lane, 0))

    def intra_in(self, lane: int, inner: int):
        """Rows of (node - ``lane``, local - ``inner``)'s travelling side this rank needs."""
        return self.rows_between(receiver=self.ring.rank, sender=self.ring.seq_rank(-lane, -inner))
