"""Sequence layouts: which global token positions each rank of a P-way sequence shard holds.

A layout maps the global sequence [0, S) to P local shards of S/P tokens each, kept in increasing
global order inside a shard:

- ``contiguous``: rank r holds [r*s, (r+1)*s).  Simple, but causal work is unbalanced (rank P-1 does
  P times the work of rank 0).
- ``zigzag`` (head-tail, DualChunkSwap): split into 2P chunks of s/2; rank r holds chunks r and
  2P-1-r.  Every rank does the same causal work per ring step.
- ``striped``: token t lives on rank t mod P.  Balanced to within one row per step; the layout that
  sequence-wise checkpointing and sliding windows want.

``burstc.compile(layout="auto")`` (:data:`AUTO`) is not a layout but a choice: the shard pass picks one of
:data:`LAYOUTS` per graph (``passes/shard.py``, ``_choose_layout``), and everything after it sees the concrete one.
"""
from __future__ import annotations

import torch

LAYOUTS = ("contiguous", "zigzag", "striped")
AUTO = "auto"
LAYOUT_OPTIONS = (AUTO, *LAYOUTS)
"""What ``burstc.compile(layout=...)`` accepts."""


def check_layout(layout: str) -> str:
    if layout not in LAYOUTS:
        raise ValueError(f"layout must be one of {LAYOUTS}, got {layout!r}")
    return layout


def required_multiple(world_size: int, layout: str) -> int:
    """The sequence length must be a multiple of this for ``layout`` on ``world_size`` ranks."""
    check_layout(layout)
    return 2 * world_size if layout == "zigzag" else world_size


def local_positions(seq_len: int, world_size: int, rank: int, layout: str, device=None) -> torch.Tensor:
    """Global positions (int64, increasing) of the tokens ``rank`` holds, in local order."""
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
