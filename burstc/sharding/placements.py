"""Where a value lives across the ranks of a sequence-parallel mesh.

Every node the shard analysis visits gets one of these small frozen values:

- :class:`Replicate`: the full value on every rank (token indices, parameters, losses after their
  all-reduce);
- :class:`Shard`: this rank's tokens, in the chosen layout, along ``dim``;
- :class:`MergedRows`: a dim that flattens (batch dims..., sequence, slots...) row-major (HF's
  ``logits.view(-1, V)``; a mixture of experts' ``top_k_index.reshape(-1)``: each token's k slots innermost);
- :class:`Permuted`: such rows reordered by a rank-local permutation (a mixture of experts' tokens sorted by
  expert);
- :class:`RowIndex`: this rank's row numbers into such rows (a sort's indices, their inverse);
- :class:`GroupSizes`: the per-group counts (or offsets) of this rank's sorted rows, for a grouped matmul;
- :class:`TuplePlacement`: the items of a tuple-valued node (``split``, ``max(x, dim)``).

The last three exist only between a sort of token rows and the un-permuting gather that ends it; the analysis
accepts them only where the whole region stays a function of each token alone (see
:mod:`burstc.sharding.dispatch_rules`).
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
    """A dim that flattens (batch dims..., sequence, slots...) row-major (e.g. HF's ``logits.view(-1, V)`` or
    GPT-2's ``x.view(-1, H)`` at batch > 1; ``top_k_index.reshape(-1)``, k slots per token): ``outer`` batch
    rows of this rank's tokens, ``inner`` entries per token, i.e. local extent ``outer * s * inner`` in (batch,
    local token, slot) order."""
    dim: int
    outer: int
    inner: int = 1

    def shifted(self, by: int) -> MergedRows:
        return MergedRows(self.dim + by, self.outer, self.inner)


def rows(dim: int, outer: int = 1, inner: int = 1) -> Shard | MergedRows:
    """The rows placement with these factors: plain :class:`Shard` when nothing is merged in."""
    return Shard(dim) if outer == 1 and inner == 1 else MergedRows(dim, outer, inner)


def factors(placement: Shard | MergedRows) -> tuple[int, int]:
    """``(outer, inner)`` of a rows placement (``(1, 1)`` for :class:`Shard`)."""
    return (placement.outer, placement.inner) if isinstance(placement, MergedRows) else (1, 1)


def at_dim(placement, dim: int):
    """The same placement with its rows in ``dim`` (an op moved them)."""
    if isinstance(placement, Shard):
        return Shard(dim)
    if isinstance(placement, MergedRows):
        return MergedRows(dim, placement.outer, placement.inner)
    if isinstance(placement, Permuted):
        return Permuted(at_dim(placement.rows, dim), placement.by)
    raise TypeError(f"{placement} has no rows dim to move")


@dataclass(frozen=True)
class Permuted:
    """The rows of a value placed ``rows`` reordered by this rank's own permutation: the indices of the sort
    node named ``by`` (tokens, or token slots, grouped by expert).  Values reordered by the same sort line up
    row for row; with anything else they do not."""
    rows: Shard | MergedRows
    by: str

    @property
    def dim(self) -> int:
        return self.rows.dim

    def shifted(self, by: int) -> Permuted:
        return Permuted(self.rows.shifted(by), self.by)


@dataclass(frozen=True)
class RowIndex:
    """A 1-D integer value of this rank's row numbers into a value placed ``target``, itself laid out as rows
    placed ``order``: a sort's indices (target: the rows sorted, order: the sorted rows), their inverse (the
    other way round), or such indices divided by the slots per token (target: the tokens).  The numbers are
    local (``0 .. local extent - 1``), so they index only local values placed ``target``."""
    target: object
    order: object

    @property
    def dim(self) -> int:
        return 0


@dataclass(frozen=True)
class GroupSizes:
    """Counts (``cumulative``: their running sum, a grouped matmul's offsets) of this rank's rows sorted by
    ``by``, per group of sort keys: a small value shaped as on one device, holding this rank's rows only."""
    by: str
    cumulative: bool


@dataclass(frozen=True)
class TuplePlacement:
    """One placement per item of a tuple-valued node whose items are sharded."""
    items: tuple

    def __getitem__(self, index):
        item = self.items[index]
        return TuplePlacement(item) if isinstance(index, slice) else item

    def __len__(self) -> int:
        return len(self.items)


Placement = Union[Replicate, Shard, MergedRows, Permuted, RowIndex, GroupSizes, TuplePlacement]
DISPATCH_PLACEMENTS = (Permuted, RowIndex, GroupSizes)
REPLICATE = Replicate()


def is_sharded(placement: Placement) -> bool:
    """Anything but :class:`Replicate`: the value holds only this rank's tokens."""
    return not isinstance(placement, Replicate)
