"""Sequence layouts: which global token positions each rank of a P-way sequence shard holds.

A layout maps the global sequence [0, S) to P local shards of S/P tokens each, kept in increasing
global order inside a shard:

- ``contiguous``: rank r holds [r*s, (r+1)*s).  Simple, but causal work is unbalanced (rank P-1 does
  P times the work of rank 0).
- ``zigzag`` (head-tail, DualChunkSwap): split into 2P chunks of s/2; rank r holds chunks r and
  2P-1-r.  Every rank does the same causal work per ring step.
- ``striped``: token t lives on rank t mod P.  Balanced to within one row per step; the layout that
  sequence-wise checkpointing and sliding windows want.

- ``documents`` (:data:`DOCUMENTS`): chosen per call from the packed documents' ids: the sequence is cut into
  ``C = k * P`` equal chunks and each rank holds ``k`` of them (:mod:`burstc.balance_documents` picks which, so the
  document-causal work is even).  The ops that take this layout also take the call's chunk owners (a ``[C]`` int64
  tensor computed in the graph, the same on every rank) and read it as a :class:`ChunkLayout`, which every function
  here accepts wherever a layout name goes.

``burstc.compile(layout="auto")`` (:data:`AUTO`) is not a layout but a choice: the shard pass picks one of
:data:`LAYOUTS` per graph (``passes/shard.py``, ``_choose_layout``), and everything after it sees the concrete one.
"""
from __future__ import annotations

import dataclasses
import functools

import torch

LAYOUTS = ("contiguous", "zigzag", "striped")
"""The static layouts: a rank's positions follow from (S, P, rank)."""
DOCUMENTS = "documents"
AUTO = "auto"
LAYOUT_OPTIONS = (AUTO, *LAYOUTS, DOCUMENTS)
"""What ``burstc.compile(layout=...)`` accepts."""
STATIC_STAND_IN = {DOCUMENTS: "zigzag"}
"""The static layout whose formulas stand for a per-call one at compile time (predicted work and bytes: documents'
chunks on a single document are zigzag's, its balanced worst case)."""


@dataclasses.dataclass(frozen=True)
class ChunkLayout:
    """One call's :data:`DOCUMENTS` layout: ``owners[c]`` is the rank holding chunk ``c`` (``chunk_len`` tokens at
    ``[c * chunk_len, (c + 1) * chunk_len)``); every rank owns the same number of chunks.  Hashable, so the block
    geometry's caches serve every layer of the call."""

    chunk_len: int
    owners: tuple[int, ...]
    name = DOCUMENTS  # what reports and counters call it

    def __post_init__(self):
        counts = [self.owners.count(r) for r in range(max(self.owners) + 1)]
        if self.chunk_len < 1 or min(counts) != max(counts):
            raise ValueError(f"chunk owners must give every rank the same number of chunks, got {counts} "
                             f"chunks of {self.chunk_len} tokens")

    @property
    def world_size(self) -> int:
        return max(self.owners) + 1

    @property
    def seq_len(self) -> int:
        return self.chunk_len * len(self.owners)

    @functools.cached_property
    def _on_devices(self) -> dict:
        """``(rank, device) -> positions`` copied to a device (:meth:`positions_on`)."""
        return {}

    def positions_on(self, rank: int, device: torch.device) -> torch.Tensor:
        """``rank``'s positions on ``device``, copied there once per layout object (every block of the call reads
        them; they live as long as the layout) and without waiting for the device
        (:func:`burstc.ops.host_reads.to_device`)."""
        from burstc.ops.host_reads import to_device

        key = (rank, device)
        if key not in self._on_devices:
            self._on_devices[key] = to_device(self.positions_PL[rank], device)
        return self._on_devices[key]

    @functools.cached_property
    def positions_PL(self) -> torch.Tensor:
        """``[P, S/P]``: each rank's global positions, increasing."""
        owner_S = torch.tensor(self.owners, dtype=torch.int64).repeat_interleave(self.chunk_len)
        order = torch.sort(owner_S, stable=True).indices  # by rank, positions increasing inside each
        return order.view(self.world_size, -1)

    @classmethod
    def from_owners(cls, owners_C: torch.Tensor, seq_len: int) -> "ChunkLayout":
        if owners_C.dim() != 1 or owners_C.numel() < 1 or seq_len % owners_C.numel():
            raise ValueError(f"chunk owners must be a [C] tensor with C dividing the sequence length {seq_len}, "
                             f"got shape {tuple(owners_C.shape)}")
        return cls(seq_len // owners_C.numel(), tuple(owners_C.tolist()))


def check_layout(layout) -> str | ChunkLayout:
    if isinstance(layout, ChunkLayout):
        return layout
    if layout not in (*LAYOUTS, DOCUMENTS):
        raise ValueError(f"layout must be one of {(*LAYOUTS, DOCUMENTS)}, got {layout!r}")
    return layout


def resolve_layout(layout: str, chunk_owners: torch.Tensor | None, seq_len: int) -> str | ChunkLayout:
    """What an op runs: its static layout name, or the call's :class:`ChunkLayout` for :data:`DOCUMENTS` (from the
    ``[C]`` owners the graph computed; given exactly for that layout)."""
    check_layout(layout)
    if (layout == DOCUMENTS) != (chunk_owners is not None):
        raise ValueError(f"chunk_owners is given exactly for layout {DOCUMENTS!r}: layout {layout!r}, chunk_owners "
                         f"{'missing' if chunk_owners is None else 'given'}")
    return layout if chunk_owners is None else ChunkLayout.from_owners(chunk_owners, seq_len)


def static_stand_in(layout) -> str:
    """The static layout a compile-time formula uses for ``layout`` (:data:`STATIC_STAND_IN`)."""
    if isinstance(layout, ChunkLayout):
        return STATIC_STAND_IN[DOCUMENTS]
    return STATIC_STAND_IN.get(check_layout(layout), layout)


def required_multiple(world_size: int, layout) -> int:
    """The sequence length must be a multiple of this for ``layout`` on ``world_size`` ranks (documents: at least
    two chunks per rank)."""
    check_layout(layout)
    if isinstance(layout, ChunkLayout):
        return len(layout.owners)
    return 2 * world_size if layout in ("zigzag", DOCUMENTS) else world_size


def local_positions(seq_len: int, world_size: int, rank: int, layout, device=None) -> torch.Tensor:
    """Global positions (int64, increasing) of the tokens ``rank`` holds, in local order."""
    if isinstance(layout, ChunkLayout):
        if (seq_len, world_size) != (layout.seq_len, layout.world_size) or not 0 <= rank < world_size:
            raise ValueError(f"a chunk layout of {layout.seq_len} tokens on {layout.world_size} ranks has no rank "
                             f"{rank} of {world_size} over {seq_len} tokens")
        return layout.positions_PL[rank] if device is None else layout.positions_on(rank, torch.device(device))
    if layout == DOCUMENTS:
        raise ValueError(f"layout {DOCUMENTS!r} is chosen per call: pass the call's ChunkLayout (resolve_layout)")
    multiple = required_multiple(world_size, layout)
    if seq_len % multiple:
        raise ValueError(
            f"sequence length {seq_len} is not a multiple of {multiple}, which layout {layout!r} "
            f"needs on {world_size} ranks"
        )
    if not 0 <= rank < world_size:
        raise ValueError(f"rank {rank} outside [0, {world_size})")
    local_len = seq_len // world_size
    if layout == "contiguous":
        return torch.arange(rank * local_len, (rank + 1) * local_len, device=device)
    if layout == "striped":
        return torch.arange(rank, seq_len, world_size, device=device)
    half = local_len // 2
    head = torch.arange(rank * half, (rank + 1) * half, device=device)
    tail_chunk = 2 * world_size - 1 - rank
    tail = torch.arange(tail_chunk * half, (tail_chunk + 1) * half, device=device)
    return torch.cat([head, tail])


def permutation(seq_len: int, world_size: int, layout: str, device=None) -> torch.Tensor:
    """All ranks' positions concatenated in rank order: ``x[..., permutation]`` is the sharded order."""
    return torch.cat([local_positions(seq_len, world_size, r, layout, device) for r in range(world_size)])


def shard(x: torch.Tensor, dim: int, world_size: int, rank: int, layout: str) -> torch.Tensor:
    """This rank's slice of ``x`` along ``dim`` (a copy for non-contiguous layouts)."""
    idx = local_positions(x.shape[dim], world_size, rank, layout, device=x.device)
    return x.index_select(dim, idx)


def unshard(shards: list[torch.Tensor], dim: int, layout: str) -> torch.Tensor:
    """Inverse of :func:`shard` over all ranks' shards (in rank order)."""
    world_size = len(shards)
    cat = torch.cat(shards, dim=dim)
    perm = permutation(cat.shape[dim], world_size, layout, device=cat.device)
    inverse = torch.empty_like(perm)
    inverse[perm] = torch.arange(perm.numel(), device=perm.device)
    return cat.index_select(dim, inverse)
