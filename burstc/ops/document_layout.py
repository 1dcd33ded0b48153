"""``burstc::document_chunks``: the call's :data:`burstc.layout.DOCUMENTS` layout, computed in the graph.

The shard pass inserts it once per graph, on the replicated document ids (``[B, S_padded]``, the same data every
ring attention of the graph reads), before any value is sharded; every ``shard_seq``, ``gather_seq`` and ring
attention of the graph then takes its output as ``chunk_owners``.  Every rank computes the same owners from the
same ids (:func:`burstc.balance_documents.chunk_owners`: integer arithmetic, fixed tie-breaks), so no
communication is needed.  The output has a fixed size, ``chunks_per_rank * world_size``, whatever coarser chunks the
balancer picked, so the graph's shapes do not depend on the data.
"""
from __future__ import annotations

import torch
from torch import Tensor

from burstc.balance_documents import chunk_owners


@torch.library.custom_op("burstc::document_chunks", mutates_args=())
def document_chunks(doc_ids_BS: Tensor, world_size: int, chunks_per_rank: int) -> Tensor:
    """``[chunks_per_rank * world_size]`` int64 owners of the equal chunks of the sequence (``doc_ids_BS``' last
    dim), balanced for ``causal & documents`` work summed over the batch."""
    if doc_ids_BS.is_floating_point() or doc_ids_BS.is_complex():
        raise TypeError(f"document ids must be integers, got {doc_ids_BS.dtype}")
    return chunk_owners(doc_ids_BS.detach().cpu(), world_size, chunks_per_rank).to(doc_ids_BS.device)


@document_chunks.register_fake
def _(doc_ids_BS, world_size, chunks_per_rank):
    return doc_ids_BS.new_empty((chunks_per_rank * world_size,), dtype=torch.int64)
