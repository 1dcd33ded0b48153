"""The document balancer: which chunks of a packed sequence each rank holds, so document-causal work is even.

Packed documents (``causal & documents``) make a fixed layout uneven: under zigzag a rank whose chunks fall at the
start of long documents does little and one at their ends a lot.  Here the sequence of S tokens is cut into
``C = k * P`` equal chunks, and each of the P ranks gets exactly ``k`` of them (so every rank holds S/P tokens: the
position-wise work stays even), chosen so that the busiest rank's unmasked score area is as close to the mean as
the chunks allow:

1. a chunk's work is the sum over its tokens of the keys each sees (the earlier tokens of its document, itself
   included): exact, from the document ids, any lengths (no divisibility requirement);
2. two seeds: the head-tail snake (chunk c to rank ``c mod P`` on even passes over the ranks, ``P - 1 - c mod P``
   on odd ones: zigzag for k = 2, which it equals on a single document), and greedy LPT (heaviest chunk first, to
   the least-loaded rank that still has room);
3. each seed improved by swaps: while some swap of a chunk of the busiest rank with a chunk of another rank lowers
   the larger of the two ranks' loads below the busiest's, make the best such swap (the sorted loads fall
   lexicographically, so it ends);
4. the better result (lower max, then lower sum of squares, then the snake).

Integer arithmetic and fixed tie-breaks only: every rank computes the same assignment from the same ids, with no
communication.  Each rank's chunks are returned in increasing order, so a rank's tokens stay in increasing global
order (the invariant of :mod:`burstc.layout` that the ring's block geometry relies on).
"""
from __future__ import annotations

import dataclasses

import torch

from burstc.planner import max_over_mean

TARGET_MAX_OVER_MEAN = 1.01
MAX_CHUNKS_PER_RANK = 32


@dataclasses.dataclass(frozen=True)
class ChunkAssignment:
    """``chunks[r]``: the chunk indices rank ``r`` holds (increasing), ``chunk_len`` tokens each; ``work[r]``: its
    unmasked causal & documents score entries (per batch row and head)."""

    chunks: tuple[tuple[int, ...], ...]
    chunk_len: int
    work: tuple[int, ...]

    @property
    def world_size(self) -> int:
        return len(self.chunks)

    @property
    def max_over_mean(self) -> float:
        return max_over_mean(self.work)

    def positions(self, rank: int) -> torch.Tensor:
        """Global positions (int64, increasing) of the tokens ``rank`` holds."""
        return torch.cat([torch.arange(c * self.chunk_len, (c + 1) * self.chunk_len) for c in self.chunks[rank]])

    def permutation(self) -> torch.Tensor:
        """All ranks' positions in rank order: ``x[..., permutation]`` is the sharded order."""
        return torch.cat([self.positions(r) for r in range(self.world_size)])


def keys_seen(doc_ids_S: torch.Tensor) -> torch.Tensor:
    """``[S]`` int64: how many keys each token sees under ``causal & documents`` (the tokens at or before it with
    its document id; ids need not be sorted or contiguous)."""
    if doc_ids_S.dim() != 1:
        raise ValueError(f"document ids must be 1-D [S], got shape {tuple(doc_ids_S.shape)}")
    seq_len = doc_ids_S.numel()
    ordered = bool((doc_ids_S[1:] >= doc_ids_S[:-1]).all())
    # same-id tokens grouped, each group in sequence order (packed ids already are: no sort)
    order = None if ordered else torch.sort(doc_ids_S, stable=True).indices
    grouped = doc_ids_S if ordered else doc_ids_S[order]
    starts = torch.ones(seq_len, dtype=torch.bool)
    starts[1:] = grouped[1:] != grouped[:-1]
    index = torch.arange(seq_len)
    group_start = torch.cummax(torch.where(starts, index, torch.zeros_like(index)), 0).values
    seen_grouped = index - group_start + 1
    if ordered:
        return seen_grouped
    seen = torch.empty(seq_len, dtype=torch.int64)
    seen[order] = seen_grouped
    return seen


def document_ids_of_lengths(lengths) -> torch.Tensor:
    """``[sum(lengths)]`` ids 0, 0, ..., 1, 1, ...: document ``i`` spans ``lengths[i]`` tokens."""
    return torch.repeat_interleave(torch.arange(len(lengths)), torch.as_tensor(list(lengths)))


def chunk_work(doc_ids: torch.Tensor, num_chunks: int) -> list[int]:
    """Score entries of each of ``num_chunks`` equal chunks' queries under ``causal & documents``; ``doc_ids`` is
    one row ``[S]`` or a batch ``[B, S]`` (whose rows share the chunks: their work adds up)."""
    seq_len = doc_ids.shape[-1]
    if num_chunks < 1 or seq_len % num_chunks:
        raise ValueError(f"sequence length {seq_len} does not split into {num_chunks} equal chunks")
    rows = doc_ids.reshape(-1, seq_len)
    return sum(keys_seen(row).view(num_chunks, -1).sum(1) for row in rows).tolist()


def balance_chunks(weights, world_size: int) -> tuple[tuple[int, ...], ...]:
    """Chunks (``weights[c]``: chunk c's work) to ``world_size`` ranks, ``len(weights) / world_size`` each, the
    busiest rank as light as the seeds and swaps of the module docstring find; each rank's chunks increasing."""
    num_chunks = len(weights)
    if world_size < 1 or num_chunks % world_size or num_chunks < world_size:
        raise ValueError(f"{num_chunks} chunks do not split evenly over {world_size} ranks")
    per_rank = num_chunks // world_size
    weight_C = torch.tensor([int(w) for w in weights], dtype=torch.int64)
    best = None
    for seed in (_snake(num_chunks, world_size), _lpt(weight_C, world_size, per_rank)):
        owner_C = _improve(weight_C, seed, world_size)
        loads = torch.zeros(world_size, dtype=torch.int64).index_add_(0, owner_C, weight_C)
        score = (int(loads.max()), int((loads * loads).sum()))
        if best is None or score < best[0]:
            best = (score, owner_C)
    owner_C = best[1]
    return tuple(tuple((owner_C == r).nonzero().flatten().tolist()) for r in range(world_size))


def assign_documents(doc_ids_S: torch.Tensor, world_size: int, chunks_per_rank: int | None = None, *,
                     target: float = TARGET_MAX_OVER_MEAN, max_chunks_per_rank: int = MAX_CHUNKS_PER_RANK
                     ) -> ChunkAssignment:
    """The balanced assignment of a packed sequence (``doc_ids_S``: one batch row's document ids, or ``[B, S]``
    whose rows' work adds up) to
    ``world_size`` ranks, ``chunks_per_rank`` (at least 2) equal chunks each.  ``None``: the fewest chunks (2, 4,
    8, ... up to ``max_chunks_per_rank``, while S splits into them) whose assignment's work max/mean is at most
    ``target``, else the most even found: long documents need small chunks, short ones balance with few (fewer
    pieces per rank, longer kernel calls)."""
    if chunks_per_rank is None:
        best = None
        k = 2
        while k <= max_chunks_per_rank and doc_ids_S.shape[-1] % (k * world_size) == 0:
            found = assign_documents(doc_ids_S, world_size, k)
            if best is None or found.max_over_mean < best.max_over_mean:
                best = found
            if found.max_over_mean <= target:
                break
            k *= 2
        if best is None:
            raise ValueError(f"sequence length {doc_ids_S.shape[-1]} does not split into {2 * world_size} equal "
                             "chunks")
        return best
    if chunks_per_rank < 2:
        raise ValueError(f"chunks_per_rank must be at least 2, got {chunks_per_rank}")
    num_chunks = chunks_per_rank * world_size
    weights = chunk_work(doc_ids_S, num_chunks)
    chunks = balance_chunks(weights, world_size)
    return ChunkAssignment(chunks, doc_ids_S.shape[-1] // num_chunks,
                           tuple(sum(weights[c] for c in mine) for mine in chunks))


def finest_chunks_per_rank(seq_len: int, world_size: int, max_chunks_per_rank: int = MAX_CHUNKS_PER_RANK) -> int:
    """The most chunks per rank :func:`assign_documents` may pick for this length (a power of two, at least 2; 0
    when the length does not split into 2 chunks per rank)."""
    k = 0
    while 2 * max(k, 1) <= max_chunks_per_rank and seq_len % (2 * max(k, 1) * world_size) == 0:
        k = 2 * max(k, 1)
    return k


def chunk_owners(doc_ids: torch.Tensor, world_size: int, chunks_per_rank: int) -> torch.Tensor:
    """``[chunks_per_rank * world_size]`` int64: the rank holding each of that many equal chunks, from the balanced
    :func:`assign_documents` (which may pick coarser chunks: each then spans several of these)."""
    found = assign_documents(doc_ids, world_size, max_chunks_per_rank=chunks_per_rank)
    coarse = torch.empty(len(found.chunks) * len(found.chunks[0]), dtype=torch.int64)
    for rank, mine in enumerate(found.chunks):
        coarse[list(mine)] = rank
    return coarse.repeat_interleave(chunks_per_rank * world_size // coarse.numel())


def zigzag_owners(world_size: int, chunks_per_rank: int) -> torch.Tensor:
    """``[chunks_per_rank * world_size]`` int64: the zigzag layout as owners of these finer chunks (zigzag's chunk
    ``z`` of ``2P`` belongs to rank ``z`` for ``z < P``, else ``2P - 1 - z``)."""
    if chunks_per_rank < 2 or chunks_per_rank % 2:
        raise ValueError(f"zigzag needs an even number of chunks per rank, got {chunks_per_rank}")
    zigzag_chunk = torch.arange(chunks_per_rank * world_size) // (chunks_per_rank // 2)
    return torch.where(zigzag_chunk < world_size, zigzag_chunk, 2 * world_size - 1 - zigzag_chunk)


def rows_needed(doc_ids: torch.Tensor, owner_S: torch.Tensor, world_size: int) -> torch.Tensor:
    """``[P]`` int64: the K/V rows (positions) of other ranks that some query of each rank sees under ``causal &
    documents`` in some batch row, what it receives in a forward (the zero-redundancy bound, which the trimmed
    ring meets).  ``doc_ids``: ``[S]`` or ``[B, S]``; ``owner_S``: each position's rank.  O(P * B * S)."""
    seq_len = doc_ids.shape[-1]
    rows = doc_ids.reshape(-1, seq_len)
    _, dense = torch.unique(rows, return_inverse=True)
    if rows.shape[0] == 1:  # one row: O(S + P * documents), no per-rank pass
        return _rows_needed_one_row(dense[0], owner_S, world_size)
    key_BS = dense + torch.arange(rows.shape[0])[:, None] * (int(dense.max()) + 1)   # a document of a batch row
    position_BS = torch.arange(seq_len).expand_as(key_BS)
    needed = torch.zeros(world_size, dtype=torch.int64)
    for rank in range(world_size):
        mine_S = owner_S == rank
        last = torch.full((int(key_BS.max()) + 1,), -1, dtype=torch.int64)
        last.scatter_reduce_(0, key_BS[:, mine_S].flatten(), position_BS[:, mine_S].flatten(), "amax")
        seen_BS = position_BS <= last[key_BS]   # a key at or before this rank's last query of its document
        needed[rank] = int((seen_BS.any(0) & ~mine_S).sum())
    return needed


def _rows_needed_one_row(dense_S: torch.Tensor, owner_S: torch.Tensor, world_size: int) -> torch.Tensor:
    """:func:`rows_needed` for one batch row (``dense_S``: document ids 0..D-1): rank r needs, of each document it
    holds tokens of, the keys at or before its last token there (``keys_seen`` at that token counts them), less
    its own tokens (all of which are at or before their document's last)."""
    documents = int(dense_S.max()) + 1
    key_S = owner_S * documents + dense_S                                   # (rank, document)
    last = torch.full((world_size * documents,), -1, dtype=torch.int64)
    last.scatter_reduce_(0, key_S, torch.arange(dense_S.numel()), "amax")
    held = last >= 0
    seen_up_to_last = keys_seen(dense_S)[last[held]]
    rank_of_key = torch.arange(world_size * documents)[held] // documents
    totals = torch.zeros(world_size, dtype=torch.int64).index_add_(0, rank_of_key, seen_up_to_last)
    return totals - torch.bincount(owner_S, minlength=world_size)


def predicted_seconds(doc_ids: torch.Tensor, owner_C: torch.Tensor, world_size: int, seconds_per_entry: float,
                      seconds_per_row: float, weights_C: torch.Tensor | None = None) -> float:
    """The busiest rank's ``max(compute, transfer)`` of a call whose chunks are owned as ``owner_C``: its score
    entries times ``seconds_per_entry`` against the rows it receives times ``seconds_per_row`` (the ring overlaps
    them).  ``weights_C``: :func:`chunk_work` of these chunks, when the caller has it."""
    if weights_C is None:
        weights_C = torch.tensor(chunk_work(doc_ids, owner_C.numel()), dtype=torch.int64)
    work = torch.zeros(world_size, dtype=torch.int64).index_add_(0, owner_C, weights_C)
    rows = rows_needed(doc_ids, owner_C.repeat_interleave(doc_ids.shape[-1] // owner_C.numel()), world_size)
    return float(torch.maximum(work.double() * seconds_per_entry, rows.double() * seconds_per_row).max())


def chunk_owners_by_cost(doc_ids: torch.Tensor, world_size: int, chunks_per_rank: int, seconds_per_entry: float,
                         seconds_per_row: float) -> tuple[torch.Tensor, str]:
    """``(owners, "balanced" | "zigzag")``: :func:`chunk_owners`, or zigzag's when it is predicted faster
    (:func:`predicted_seconds`): behind slow links the balanced chunks' extra rows can cost more than zigzag's
    uneven work.  Ties go to the balanced chunks."""
    balanced = chunk_owners(doc_ids, world_size, chunks_per_rank)
    zigzag = zigzag_owners(world_size, chunks_per_rank)
    if torch.equal(balanced, zigzag):
        return balanced, "balanced"
    weights_C = torch.tensor(chunk_work(doc_ids, zigzag.numel()), dtype=torch.int64)  # both candidates' chunks
    costs = [predicted_seconds(doc_ids, owners, world_size, seconds_per_entry, seconds_per_row, weights_C)
             for owners in (balanced, zigzag)]
    return (zigzag, "zigzag") if costs[1] < costs[0] else (balanced, "balanced")


def _snake(num_chunks: int, world_size: int) -> torch.Tensor:
    chunk = torch.arange(num_chunks)
    rank, sweep = chunk % world_size, chunk // world_size
    return torch.where(sweep % 2 == 0, rank, world_size - 1 - rank)


def _lpt(weight_C: torch.Tensor, world_size: int, per_rank: int) -> torch.Tensor:
    """Heaviest chunk first (ties: lower index), to the least-loaded rank with room (ties: lower rank)."""
    order = sorted(range(weight_C.numel()), key=lambda c: (-int(weight_C[c]), c))
    loads, counts = [0] * world_size, [0] * world_size
    owner = [0] * weight_C.numel()
    for c in order:
        rank = min((r for r in range(world_size) if counts[r] < per_rank), key=lambda r: (loads[r], r))
        owner[c] = rank
        loads[rank] += int(weight_C[c])
        counts[rank] += 1
    return torch.tensor(owner, dtype=torch.int64)


def _improve(weight_C: torch.Tensor, owner_C: torch.Tensor, world_size: int, max_swaps: int = 10_000) -> torch.Tensor:
    """Best swaps between the busiest rank (lowest index on ties) and another, while one lowers the pair's larger
    load below the busiest's."""
    owner_C = owner_C.clone()
    loads = torch.zeros(world_size, dtype=torch.int64).index_add_(0, owner_C, weight_C)
    for _ in range(max_swaps):
        busiest = int(torch.argmax(loads))  # first maximum
        mine = (owner_C == busiest).nonzero().flatten()
        w_mine, w_all = weight_C[mine][:, None], weight_C[None, :]
        new_busiest = loads[busiest] - w_mine + w_all
        new_other = loads[owner_C][None, :] - w_all + w_mine
        worst = torch.maximum(new_busiest, new_other)
        worst[:, owner_C == busiest] = torch.iinfo(torch.int64).max
        flat = int(torch.argmin(worst))  # first minimum: fixed tie-break
        i, j = divmod(flat, weight_C.numel())
        if int(worst[i, j]) >= int(loads[busiest]):
            break
        x, other = int(mine[i]), int(owner_C[j])
        loads[busiest] += weight_C[j] - weight_C[x]
        loads[other] += weight_C[x] - weight_C[j]
        owner_C[x], owner_C[j] = other, busiest
    return owner_C
