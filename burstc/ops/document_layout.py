"""``burstc::document_chunks``: the call's :data:`burstc.layout.DOCUMENTS` layout, computed in the graph.

The shard pass inserts it once per graph, on the replicated document ids (``[B, S_padded]``, the same data every
ring attention of the graph reads), before any value is sharded; every ``shard_seq``, ``gather_seq`` and ring
attention of the graph then takes its output as ``chunk_owners``.  Every rank computes the same owners from the
same ids (:func:`burstc.balance_documents.chunk_owners`: integer arithmetic, fixed tie-breaks), so no
communication is needed.  The output has a fixed size, ``chunks_per_rank * world_size``, whatever coarser chunks the
balancer picked, so the graph's shapes do not depend on the data.

Given the cost model's ``seconds_per_entry`` (compute of one score entry, summed over the graph's ring attentions)
and ``seconds_per_row`` (moving one K/V row over the ring's slowest link, forward and backward, summed likewise),
the op also prices zigzag's owners for the call and returns them when they are predicted faster
(:func:`burstc.balance_documents.chunk_owners_by_cost`): the balanced chunks even the work but make a rank receive
more rows, which behind slow links can cost more than zigzag's uneven work.  The choice is per call, from the
call's documents; every rank makes the same one.
"""
from __future__ import annotations

import torch
from torch import Tensor

from burstc.balance_documents import chunk_owners, chunk_owners_by_cost

_CHOICES = {"balanced": 0, "zigzag": 0}  # calls that took each (``choices()``: for tests and benchmarks)


def choices() -> dict[str, int]:
    """How many calls of this process took the balanced chunks and how many zigzag's."""
    return dict(_CHOICES)


@torch.library.custom_op("burstc::document_chunks", mutates_args=())
def document_chunks(doc_ids_BS: Tensor, world_size: int, chunks_per_rank: int, seconds_per_entry: float = 0.0,
                    seconds_per_row: float = 0.0) -> Tensor:
    """``[chunks_per_rank * world_size]`` int64 owners of the equal chunks of the sequence (``doc_ids_BS``' last
    dim), balanced for ``causal & documents`` work summed over the batch; with both costs > 0, zigzag's owners
    where the cost model predicts them faster for this call."""
    if doc_ids_BS.is_floating_point() or doc_ids_BS.is_complex():
        raise TypeError(f"document ids must be integers, got {doc_ids_BS.dtype}")
    ids = doc_ids_BS.detach().cpu()
    if seconds_per_entry > 0 and seconds_per_row > 0:
        owners, choice = chunk_owners_by_cost(ids, world_size, chunks_per_rank, seconds_per_entry, seconds_per_row)
    else:
        owners, choice = chunk_owners(ids, world_size, chunks_per_rank), "balanced"
    _CHOICES[choice] += 1
    return owners.to(doc_ids_BS.device)


@document_chunks.register_fake
def _(doc_ids_BS, world_size, chunks_per_rank, seconds_per_entry=0.0, seconds_per_row=0.0):
    return doc_ids_BS.new_empty((chunks_per_rank * world_size,), dtype=torch.int64)
