"""The balance simulator: per-rank work and bytes of one ring attention call, without ranks.

For a mask, a layout and P (up to 64 and beyond), :func:`simulate` counts what every rank of the ring
op computes (:func:`burstc.planner.predicted_work`, from :func:`burstc.block_geometry.blocks`) and
sends and receives per step (:func:`burstc.planner.predicted_transfers`, from
:func:`burstc.block_geometry.travelling_rows`): the functions the op itself calls, so the simulation
cannot drift from what runs (tests compare it with the counters of real 2- and 4-rank runs).  Beside
them, the zero-redundancy bound (:func:`burstc.planner.zero_redundancy_bound`) and the mask-blind
ring's bytes.  Runtime terms (documents, padding) are data: the static part is simulated (what travels
in the pairs the data leave some entry of, and a bound on the work), or with the data given the pairs
they hide send nothing, as in the op.

    python -m burstc.testing.balance --mask causal --layout zigzag --P 64 --S 65536
    python -m burstc.testing.balance --mask window:4096 --layout contiguous striped --P 8 16 --S 65536
"""
from __future__ import annotations

import argparse
import dataclasses

import torch

from burstc.attention_ir import MaskSpec, SlidingWindow
from burstc.layout import LAYOUTS, required_multiple
from burstc.block_geometry import pairs_hidden_by_data
from burstc.planner import data_zero_redundancy_bound, masked_plan, max_over_mean, predicted_transfers, \
    predicted_work


def parse_mask(text: str) -> MaskSpec:
    """``window:W`` is HF's ``sliding_window=W`` (causal, W keys including the query's own); anything
    else is a :meth:`MaskSpec.encode` string (``full``, ``causal``, ``causal&window(7,-)``, ...)."""
    if text.startswith("window:"):
        return MaskSpec.causal() & SlidingWindow(int(text.removeprefix("window:")) - 1)
    return MaskSpec.decode(text)


@dataclasses.dataclass(frozen=True)
class Balance:
    """One simulated call.  ``work``: score entries per rank (B * Hq * visible pairs, as the op's
    counters count them) in the forward and the ``kv_ring`` backward; ``work_by_op`` the same per op
    (``"forward"``, ``"kv_ring"``, ``"burst"``: the burst backward computes at the keys' owner).  ``transfers``: :class:`burstc.planner.Transfers` per op (``"forward"``,
    ``"kv_ring"``, ``"burst"``); ``bound``: the zero-redundancy bytes each rank must receive, per op;
    ``dense``: bytes per rank of the mask-blind ring, per op.  With runtime data the bound counts each batch row's
    needs alone (``data_zero_redundancy_bound(..., per_batch_row=True)``), so ``over_bound`` >= 1 holds for the
    batch groups too."""

    mask: MaskSpec
    layout: str
    world_size: int
    seq_len: int
    plan: str
    work: tuple[int, ...]
    work_by_op: dict
    transfers: dict
    bound: dict
    dense: dict

    @property
    def work_max_over_mean(self) -> float:
        return max_over_mean(self.work)

    def bytes_per_rank(self, op: str = "forward") -> int:
        """The most any rank receives (or sends: the larger) in one call of ``op``."""
        return max(max(self.transfers[op].received), max(self.transfers[op].sent))

    def over_bound(self, op: str = "forward") -> float:
        from burstc.planner import over_bound

        return over_bound(self.transfers[op].received, self.bound[op])


def simulate(mask: MaskSpec | str, layout: str, world_size: int, seq_len: int, *, batch: int = 1, heads_q: int = 32,
             heads_kv: int = 8, head_dim: int = 128, dtype: torch.dtype | int = torch.bfloat16,
             plan: str = "auto", doc_ids: torch.Tensor | None = None, key_valid: torch.Tensor | None = None
             ) -> Balance:
    """Per-rank work and bytes of one call on ``world_size`` ranks (defaults: a Llama-3-8B-like
    attention layer in bf16).  With the runtime terms' data (``doc_ids`` / ``key_valid``, ``[B, S]``),
    the pairs the data hide move nothing, as in the op (the work stays the static part's, an upper
    bound)."""
    mask = parse_mask(mask) if isinstance(mask, str) else mask
    static = mask.static_part
    masked = masked_plan(layout, static, seq_len, world_size, batch, heads_q, heads_kv, head_dim, dtype, plan)
    bound = masked.bound_per_rank
    if doc_ids is not None or key_valid is not None:
        # each batch row's own needs: the op's batch groups send at least this, the unsplit batch more
        bound = data_zero_redundancy_bound(layout, mask, seq_len, world_size, batch, heads_q, heads_kv, head_dim,
                                           dtype, doc_ids, key_valid, per_batch_row=True)
        transfers = data_transfers(
            lambda group_batch, hidden, rows: predicted_transfers(layout, static, seq_len, world_size, group_batch,
                                                                  heads_q, heads_kv, head_dim, dtype, hidden,
                                                                  rows_between=rows),
            layout, mask, seq_len // world_size, world_size, batch, doc_ids, key_valid)
        masked = dataclasses.replace(masked, transfers=transfers)
    work_by_op = {op: tuple(batch * heads_q * w for w in predicted_work(layout, static, seq_len, world_size,
                                                                        op == "burst").per_rank)
                  for op in ("forward", "kv_ring", "burst")}
    dense = {"forward": masked.dense["forward"]}
    for name in ("kv_ring", "burst"):
        dense[name] = masked_plan(layout, static, seq_len, world_size, batch, heads_q, heads_kv, head_dim, dtype,
                                  name).dense["backward"]
    return Balance(mask, layout, world_size, seq_len, masked.plan, work_by_op["forward"], work_by_op,
                   masked.transfers, bound, dense)


def data_rows(layout, mask: MaskSpec, local_len: int, world_size: int, doc_ids, key_valid):
    """``rows_between(queries_travel, receiver, sender)``: the op's travelling rows with this call's data (the op's
    own ``burstc.ops.ring_loops._rows_between``, over every pair), for :func:`burstc.planner.predicted_transfers`."""
    from types import SimpleNamespace

    from burstc.ops.ring_loops import MaskData, _rows_between

    ring, data = SimpleNamespace(size=world_size, rank=None), MaskData(doc_ids, key_valid)
    sides = {queries_travel: _rows_between(queries_travel, layout, mask, local_len, ring, data, any_pair=True)
             for queries_travel in (False, True)}
    return lambda queries_travel, receiver, sender: sides[queries_travel](receiver=receiver, sender=sender)


def data_transfers(predict, layout, mask: MaskSpec, local_len: int, world_size: int, batch: int, doc_ids, key_valid
                   ) -> dict:
    """What the op sends with a call's data (``[B, S]`` each, or None): ``predict(batch, hidden_pairs, rows_between)``
    (a planner prediction, :class:`burstc.planner.Transfers` per op) for each of the call's batch groups
    (:mod:`burstc.ops.batch_groups`: a padded batch whose rows disagree runs one loop per group, each sending its
    own rows), with that group's hidden pairs and travelling rows, summed."""
    from burstc.ops.batch_groups import batch_row_groups, row_count
    from burstc.ops.ring_loops import MaskData

    total = None
    for group in batch_row_groups(MaskData(doc_ids, key_valid), batch):
        docs, valid = group.data.doc_ids_BS, group.data.key_valid_BS
        group_batch = row_count(group.rows, batch)
        hidden = pairs_hidden_by_data(layout, mask, local_len, world_size, docs, valid)
        found = predict(group_batch, hidden, data_rows(layout, mask, local_len, world_size, docs, valid))
        total = found if total is None else {op: _add_transfers(total[op], found[op]) for op in total}
    return total


def batch_groups_bound(layout, mask: MaskSpec, seq_len: int, world_size: int, batch: int, heads_q: int,
                       heads_kv: int, head_dim: int, dtype, doc_ids, key_valid) -> dict[str, tuple[int, ...]]:
    """The zero-redundancy bound of the batch groups the op runs a call's data as (each group's bound, summed):
    what a call that sends each group's rows once to each rank needing them receives; between the per-batch-row
    bound and the whole batch's (:func:`burstc.planner.data_zero_redundancy_bound`)."""
    from burstc.ops.batch_groups import batch_row_groups, row_count
    from burstc.ops.ring_loops import MaskData

    total: dict[str, tuple[int, ...]] = {}
    for group in batch_row_groups(MaskData(doc_ids, key_valid), batch):
        found = data_zero_redundancy_bound(layout, mask, seq_len, world_size, row_count(group.rows, batch), heads_q,
                                           heads_kv, head_dim, dtype, group.data.doc_ids_BS, group.data.key_valid_BS)
        total = {op: tuple(a + b for a, b in zip(total.get(op, (0,) * world_size), got)) for op, got in found.items()}
    return total


def _add_transfers(a, b):
    def add_links(x: dict, y: dict) -> dict:
        return {link: x.get(link, 0) + y.get(link, 0) for link in {**x, **y}}

    return dataclasses.replace(
        a, sent_per_step=tuple(tuple(map(sum, zip(r, s))) for r, s in zip(a.sent_per_step, b.sent_per_step)),
        received_per_step=tuple(tuple(map(sum, zip(r, s))) for r, s in zip(a.received_per_step, b.received_per_step)),
        sent_by_link_per_step=tuple(tuple(add_links(x, y) for x, y in zip(r, s))
                                    for r, s in zip(a.sent_by_link_per_step, b.sent_by_link_per_step)))


def table_row(balance: Balance) -> str:
    plan = balance.plan
    mib = lambda n: f"{n / 2**20:.2f}"  # noqa: E731
    return (f"| {balance.mask.encode()} | {balance.layout} | {balance.world_size} | {balance.seq_len} "
            f"| {mib(balance.bytes_per_rank('forward'))} | {mib(max(balance.bound['forward']))} "
            f"| {balance.over_bound('forward'):.3f} | {plan} {mib(balance.bytes_per_rank(plan))} "
            f"| {mib(max(balance.bound[plan]))} | {balance.over_bound(plan):.3f} "
            f"| {balance.bytes_per_rank('forward') / balance.dense['forward']:.4f} "
            f"| {sum(balance.transfers['forward'].sent) / (balance.dense['forward'] * balance.world_size):.4f} "
            f"| {balance.work_max_over_mean:.3f} |")


HEADER = ("| mask | layout | P | S | fwd MiB/rank | fwd bound | fwd ratio | bwd plan MiB/rank | bwd bound | bwd ratio "
          "| fwd / dense ring, busiest rank | all ranks | work max/mean |\n"
          "|---|---|---|---|---|---|---|---|---|---|---|---|---|")


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--mask", nargs="+", default=["causal"], help="MaskSpec encodings or window:W")
    parser.add_argument("--layout", nargs="+", default=list(LAYOUTS), choices=LAYOUTS)
    parser.add_argument("--P", nargs="+", type=int, default=[64])
    parser.add_argument("--S", type=int, default=65536)
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--heads", default="32/8", help="query/kv heads, e.g. 32/8")
    parser.add_argument("--head-dim", type=int, default=128)
    args = parser.parse_args(argv)
    torch.set_num_threads(1)  # many tiny tensor ops: threads only contend
    heads_q, heads_kv = (int(x) for x in args.heads.split("/"))
    print(HEADER)
    for mask in args.mask:
        for world_size in args.P:
            for layout in args.layout:
                if args.S % required_multiple(world_size, layout):
                    continue
                print(table_row(simulate(mask, layout, world_size, args.S, batch=args.batch, heads_q=heads_q,
                                    heads_kv=heads_kv, head_dim=args.head_dim)), flush=True)


if __name__ == "__main__":
    main()


# ---------------------------------------------------------------------------------------------
# Packed documents: per-rank work of the document balancers, counted on the token assignment each makes

DOCUMENT_SCHEMES = ("zigzag", "burstc", "torch_head_tail", "torch_head_tail_intended", "torch_ptrr", "te_padded")
"""``zigzag``: burstc's layout before the balancer; ``burstc``: :func:`burstc.balance_documents.assign_documents`;
``torch_head_tail``: torch's ``_PerDocumentHeadTailLoadBalancer`` as torch 2.13 ships it (its indices list each
document's pieces rank by rank, document after document, and context parallelism cuts that order into P equal
slices, so a rank gets whole runs of documents, not a head and a tail of each); ``torch_head_tail_intended``: the
head and tail of every document on every rank, as its docstring draws it; both with the 2P pieces of a document
of any length ``torch.tensor_split``'s (torch itself asserts every length is a multiple of 2P); ``torch_ptrr``:
``_PTRRLoadBalancer.ptrr_scheduling`` (torch's own function) over FlexAttention's 128-token query blocks, weighted
as it weighs them (KV blocks with any visible entry); ``te_padded``: TransformerEngine's scheme, every document
padded to a multiple of 2P and split head-tail (the pads are wasted tokens: they travel and take memory, but are
no query's key)."""

PTRR_BLOCK = 128  # FlexAttention's default block size


@dataclasses.dataclass(frozen=True)
class DocumentBalance:
    """One scheme on one packed sequence: ``work[r]``: causal & documents score entries of rank r's real queries;
    ``tokens[r]``: the tokens it holds (pads included); ``padding``: pad tokens added in all; ``pieces``: the most
    runs of consecutive positions one rank holds (kernel calls and transfers fragment with them)."""

    scheme: str
    work: tuple[int, ...]
    tokens: tuple[int, ...]
    padding: int
    pieces: int

    @property
    def work_max_over_mean(self) -> float:
        return max_over_mean(self.work)


def _head_tail_pieces(lengths, world_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Per token of the packed sequence: ``(its document's index, its piece 0..2P-1)``, pieces as
    ``torch.tensor_split(document, 2P)`` cuts them (the first ``L mod 2P`` one token longer)."""
    lengths_D = torch.as_tensor(list(lengths), dtype=torch.int64)
    doc_S = torch.repeat_interleave(torch.arange(len(lengths_D)), lengths_D)
    starts_D = torch.cumsum(lengths_D, 0) - lengths_D
    offset_S = torch.arange(doc_S.numel()) - starts_D[doc_S]
    short, extra = lengths_D[doc_S] // (2 * world_size), lengths_D[doc_S] % (2 * world_size)
    long_part = extra * (short + 1)
    piece_S = torch.where(offset_S < long_part, offset_S // (short + 1),
                          extra + (offset_S - long_part) // short.clamp(min=1))
    return doc_S, piece_S


def _owners_pieces(owner_S: torch.Tensor, world_size: int) -> int:
    changes = torch.ones_like(owner_S, dtype=torch.bool)
    changes[1:] = owner_S[1:] != owner_S[:-1]
    return int(torch.bincount(owner_S[changes], minlength=world_size).max())


def simulate_documents(lengths, world_size: int, scheme: str, chunks_per_rank: int | None = None
                       ) -> DocumentBalance:
    """Per-rank work of ``scheme`` (:data:`DOCUMENT_SCHEMES`) on a packed sequence of documents of ``lengths``
    tokens under ``causal & documents``, on ``world_size`` ranks."""
    from burstc.balance_documents import assign_documents, document_ids_of_lengths, keys_seen
    from burstc.layout import local_positions

    lengths = [int(n) for n in lengths]
    seq_len, P = sum(lengths), world_size
    doc_ids_S = document_ids_of_lengths(lengths)
    seen_S = keys_seen(doc_ids_S)
    padding = 0
    if scheme == "zigzag":
        owner_S = torch.empty(seq_len, dtype=torch.int64)
        for rank in range(P):
            owner_S[local_positions(seq_len, P, rank, "zigzag")] = rank
    elif scheme == "burstc":
        assignment = assign_documents(doc_ids_S, P, chunks_per_rank)
        owner_S = torch.empty(assignment.world_size * len(assignment.chunks[0]), dtype=torch.int64)
        for rank, chunks in enumerate(assignment.chunks):
            owner_S[list(chunks)] = rank
        owner_S = owner_S.repeat_interleave(assignment.chunk_len)
    elif scheme in ("torch_head_tail", "torch_head_tail_intended"):
        doc_S, piece_S = _head_tail_pieces(lengths, P)
        rank_piece_S = torch.where(piece_S < P, piece_S, 2 * P - 1 - piece_S)  # pieces r and 2P-1-r: rank r
        if scheme == "torch_head_tail_intended":
            owner_S = rank_piece_S
        else:  # the shipped order: document by document, in each rank by rank (head, tail); cut into P slices
            order = torch.argsort(doc_S * (2 * P) + 2 * rank_piece_S + (piece_S >= P), stable=True)
            owner_S = torch.empty(seq_len, dtype=torch.int64)
            owner_S[order] = torch.arange(seq_len) * P // seq_len
    elif scheme == "torch_ptrr":
        from torch.distributed.tensor.experimental._context_parallel._load_balancer import _PTRRLoadBalancer

        if seq_len % (PTRR_BLOCK * P):
            raise ValueError(f"torch_ptrr needs S a multiple of {PTRR_BLOCK} * P")
        first_row = torch.arange(0, seq_len, PTRR_BLOCK)
        doc_start_S = torch.arange(seq_len) - seen_S + 1
        block = first_row // PTRR_BLOCK
        kv_blocks = block - doc_start_S[first_row] // PTRR_BLOCK + 1  # its rows see keys [doc start, last row]
        groups = _PTRRLoadBalancer.ptrr_scheduling(kv_blocks, P)  # [P, blocks per rank]
        owner_B = torch.empty(block.numel(), dtype=torch.int64)
        for rank in range(P):
            owner_B[groups[rank]] = rank
        owner_S = owner_B.repeat_interleave(PTRR_BLOCK)
    elif scheme == "te_padded":
        padded = [-(-n // (2 * P)) * (2 * P) for n in lengths]
        padding = sum(padded) - seq_len
        doc_S, piece_S = _head_tail_pieces(padded, P)
        owner_padded = torch.where(piece_S < P, piece_S, 2 * P - 1 - piece_S)
        starts = torch.tensor([0, *padded[:-1]]).cumsum(0)
        real = torch.cat([torch.arange(s, s + n) for s, n in zip(starts.tolist(), lengths)])
        tokens = torch.bincount(owner_padded, minlength=P)
        work = torch.bincount(owner_padded[real], weights=seen_S.double(), minlength=P)
        return DocumentBalance(scheme, tuple(int(w) for w in work), tuple(tokens.tolist()), padding,
                               _owners_pieces(owner_padded, P))
    else:
        raise ValueError(f"scheme must be one of {DOCUMENT_SCHEMES}, got {scheme!r}")
    work = torch.zeros(P, dtype=torch.int64).index_add_(0, owner_S, seen_S)
    return DocumentBalance(scheme, tuple(work.tolist()), tuple(torch.bincount(owner_S, minlength=P).tolist()),
                           padding, _owners_pieces(owner_S, P))


def sample_document_lengths(seq_len: int, generator: torch.Generator, longest: int | None = None) -> list[int]:
    """A long-tailed mix of document lengths filling ``seq_len`` (each at most ``longest``, default S/4): lengths
    log-normal, their median drawn log-uniformly in [128, 16384] and their log-spread uniformly in [0.5, 2] per
    mix (so some mixes are mostly short documents, some mostly long ones); the last one cut to fit."""
    import math

    longest = longest or seq_len // 4
    log_median = math.log(128) + float(torch.rand((), generator=generator)) * math.log(16384 / 128)
    spread = 0.5 + 1.5 * float(torch.rand((), generator=generator))
    lengths, total = [], 0
    while total < seq_len:
        draw = math.exp(log_median + spread * float(torch.randn((), generator=generator)))
        length = min(longest, max(1, round(draw)), seq_len - total)
        lengths.append(length)
        total += length
    return lengths
