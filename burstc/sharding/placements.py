"""Where a value lives across the ranks of a sequence-parallel mesh.

Every node the shard analysis visits gets one of these small frozen values:

- :class:`Replicate`: the full value on every rank (token indices, parameters, losses after their
  all-reduce);
- :class:`Shard`: this rank's tokens, in the chosen layout, along ``dim``;
- :class:`MergedRows`: a dim that flattens (batch dims..., sequence) row-major, the sequence innermost
  (HF's ``logits.view(-1, V)``);
- :class:`TuplePlacement`: the items of a tuple-valued node (``split``, ``max(x, dim)``).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Union


@dataclass(frozen=True)
class Replicate:
    """The whole value on every rank."""

    def __repr__(self) -> str:
        return "Replicate()"


@dataclass(frozen=True)
class Shard:
    """This rank's tokens along ``dim`` (local extent ``s = padded S / P``)."""
    dim: int

    def shifted(self, by: int) -> Shard:
        """The same placement in a value with ``by`` more leading dims (broadcasting)."""
        return Shard(self.dim + by)


@dataclass(frozen=True)
class MergedRows:
    """A dim that flattens (batch dims..., sequence) row-major, the sequence innermost (e.g. HF's
    ``logits.view(-1, V)`` or GPT-2's ``x.view(-1, H)`` at batch > 1): ``outer`` batch rows of this
    rank's tokens each, i.e. local extent ``outer * s`` in (batch, local token) order."""
    dim: int
    outer: int

    def shifted(self, by: int) -> MergedRows:
        return MergedRows(self.dim + by, self.outer)


@dataclass(frozen=True)
class TuplePlacement:
    """One placement per item of a tuple-valued node whose items are sharded."""
    items: tuple

    def __getitem__(self, index):
        item = self.items[index]
        return TuplePlacement(item) if isinstance(index, slice) else item

    def __len__(self) -> int:
        return len(self.items)


Placement = Union[Replicate, Shard, MergedRows, TuplePlacement]
REPLICATE = Replicate()


def is_sharded(placement: Placement) -> bool:
    """Anything but :class:`Replicate`: the value holds only this rank's tokens."""
    return not isinstance(placement, Replicate)
