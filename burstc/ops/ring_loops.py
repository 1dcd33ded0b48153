"""The ring loops: the forward and the one backward, over a :class:`burstc.ops.ring_comm.Ring`.

Forward: each rank's K/V (with their ``Hkv`` heads, never repeated) visit every other rank; each rank
attends its resident queries to every visiting block and merges the partial ``(out, lse)`` in fp32.

Backward, parametrized by what travels (:data:`BACKWARD_PLANS`):

* ``kv_ring``: K, V visit again, and the visited rank returns fp32 dK, dV partials for them.  Q, dO,
  dQ stay home.
* ``burst`` (BurstAttention): Q, dO, LSE and ``delta = rowsum(O * dO)`` visit, and the visited rank
  returns an fp32 dQ partial.  K, V, dK, dV never leave home.

Mask-aware transfers, in the direct pattern: at step t every rank sends its OWN travelling rows to
rank + t and receives rank - t's (not a relay: nothing passes through a rank that does not need it),
and only the rows the receiver needs, :func:`burstc.block_geometry.travelling_rows` (a pure function
of the layout, the mask's static part and the pair, so both sides of a pair agree on what is sent and
what is skipped: a pair the mask hides moves nothing, a sliding window's neighbour sends its halo).
The rows arrive compact and are unpacked into a whole-shard buffer, so the blocks of
:func:`burstc.block_geometry.blocks` index them as before.  In the backward, the gradients of the
rows received at step t go back to their owner at step t + 1 (the last step's in one extra hop).
Transfers are double-buffered: the next step's transfers are posted before the current block is
computed and waited for after; a step posts receives before sends.  The bytes are what
:func:`burstc.planner.predicted_transfers` counts (tested per rank and step).
Which (query, key) entries of a pair are computed is :func:`burstc.block_geometry.blocks`'s answer;
full, causal and anti-causal blocks without score mods run the flash-style kernels of
:mod:`burstc.kernels.attention_blocks` (anti-causal on reversed rows and keys), the others the position-masked kernels of
:mod:`burstc.kernels.masked_attention_blocks`.

Runtime terms (documents, key padding): their data (``doc_ids_BS``, ``key_valid_BS``, the whole
sequence on every rank) are evaluated element-wise, so the blocks of the static geometry
(``mask.static_part``) run the masked kernel, and a pair whose data show nothing visible (disjoint
document-id ranges, or no valid key, in every batch row) is neither computed nor sent (every rank
decides it from the same replicated data, :func:`burstc.block_geometry.pairs_hidden_by_data`; other
pairs send their static part's rows).  Packed documents (sorted ids) cut the blocks to the documents
(:func:`burstc.block_geometry.data_blocks`): a piece inside one document keeps the flash-style kernel
(``data_free``), and only the rows the pieces read travel.  No block need then cover every query row, and a row may see nothing at all: the forward merge starts from an empty accumulator
(out 0, lse -inf) and such a row ends with out 0, lse -inf (as single-device SDPA's 0) and zero
gradients.  Work counters count the entries the data leave visible.
LSE convention: :mod:`burstc.ops.lse_merge`.
"""
from __future__ import annotations

import dataclasses
import functools
from typing import Callable, Iterator, Sequence

import torch
from torch import Tensor

from burstc.attention_ir import Documents, KeyPadding, MaskSpec, SlidingWindow
from burstc.kernels.attention_blocks import block_attention_backward, block_attention_forward
from burstc.kernels.masked_attention_blocks import masked_block_backward, masked_block_forward, visible_entries
from burstc.block_geometry import (ANTI_CAUSAL, POSITIONS, Block, Runs, blocks, data_blocks, document_travelling_rows,
                                   clip_pair_to_rows, documents_sorted, intersect_runs, keys_of,
                                   pairs_hidden_by_data, runs_length, travelling_rows, valid_key_runs)
from burstc.layout import local_positions
import burstc.ops.document_layout  # noqa: F401  (registers burstc::document_chunks)
from burstc.ops.batch_groups import BatchGroup, batch_row_groups, take_rows
from burstc.ops.head_groups import GroupLoop, call_head_slices, run_pipelined, start_pipelined
from burstc.ops import host_reads
from burstc.ops.lse_merge import ACC_DTYPE, attention_delta, merge_attention_block_, merge_attention_block_or_empty_
from burstc.ops.ring_comm import Ring, TwoLevelRing, UlyssesRing, wait
from burstc.ops.ring_stats import CallRecorder

_DQ, _DK, _DV = 0, 1, 2  # positions in a block's (dq, dk, dv)


@dataclasses.dataclass(frozen=True)
class BackwardPlan:
    """What travels in the backward: the query side (Q, dO, LSE, delta with a dQ accumulator) or the
    key side (K, V with dK, dV accumulators).  The other side and its gradients stay home."""

    queries_travel: bool

    @property
    def travelling_grads(self) -> tuple[int, ...]:
        return (_DQ,) if self.queries_travel else (_DK, _DV)

    @property
    def home_grads(self) -> tuple[int, ...]:
        return (_DK, _DV) if self.queries_travel else (_DQ,)


BACKWARD_PLANS = {"kv_ring": BackwardPlan(queries_travel=False), "burst": BackwardPlan(queries_travel=True)}


@dataclasses.dataclass(frozen=True)
class MaskData:
    """Runtime mask data over the whole sequence (``[B, S_global]``, indexed by global position):
    document ids and key validity, each None when the spec lacks its term."""

    doc_ids_BS: Tensor | None = None
    key_valid_BS: Tensor | None = None
    # a forward over each rank's first query rows only (a checkpoint's recompute of the rows it did not keep): the
    # result holds just those rows, and only the key rows they see travel; None: every row
    query_rows: int | None = None
    # a backward whose delta includes an lse gradient (a row with grad_out 0 may have delta != 0)
    lse_grad: bool = False

    # the same data readable on the host (:mod:`burstc.ops.host_reads`): every decision of the call (blocks, hidden
    # pairs, travelling rows, batch groups) reads these, the kernels the tensors above; None: made when first read
    host_data: MaskData | None = dataclasses.field(default=None, compare=False, repr=False)

    def kernel_args(self) -> dict:
        return {"doc_ids_BS": self.doc_ids_BS, "key_valid_BS": self.key_valid_BS}

    @functools.cached_property
    def host(self) -> MaskData:
        """This call's data on the host (itself when its tensors already are: the CPU)."""
        if self.host_data is not None:
            return self.host_data
        if all(t is None or host_reads.on_host(t) for t in (self.doc_ids_BS, self.key_valid_BS)):
            return self
        host = MaskData(host_reads.host_copy(self.doc_ids_BS), host_reads.host_copy(self.key_valid_BS),
                        self.query_rows, self.lse_grad)
        object.__setattr__(host, "host_data", host)  # the copy is its own host data
        return host

    @functools.cached_property
    def memo(self) -> dict:
        """Per-call answers (a pair's blocks): the data are the call's, so is the memo."""
        return {}

    @functools.cached_property
    def packed_documents(self) -> bool:
        """Document ids nondecreasing in every row: blocks can be trimmed to the documents
        (:func:`trim_blocks_to_documents`)."""
        return self.doc_ids_BS is not None and documents_sorted(self.host.doc_ids_BS)


def _pair_blocks(layout: str, mask: MaskSpec, q_owner: int, kv_owner: int, local_len: int, ring: Ring,
                 data: MaskData) -> tuple[Block, ...]:
    """The blocks of a pair with this call's data (:func:`data_blocks`), remembered for the call; with
    ``data.query_rows``, their part on the first query rows (:func:`clip_query_rows`)."""
    if not mask.runtime_terms and data.query_rows is None:
        return blocks(layout, mask, q_owner, kv_owner, local_len, ring.size)
    key = ("blocks", layout, mask, q_owner, kv_owner, local_len, ring.size)
    if key not in data.memo:
        found = blocks(layout, mask, q_owner, kv_owner, local_len, ring.size) if not mask.runtime_terms else \
            data_blocks(layout, mask, q_owner, kv_owner, local_len, ring.size, **data.host.kernel_args(),
                        packed_documents=data.packed_documents)
        if data.query_rows is not None:
            found = clip_pair_to_rows(found, data.query_rows, layout, mask, q_owner, kv_owner, local_len, ring.size)
        if mask.term(KeyPadding) is not None:
            # a block whose every key is padding in every batch row sees nothing, and those rows never travel
            # (:func:`_rows_between`): not computed (fuzz seed 2028 case 332: it raised on some ranks, hung the rest;
            # seed 282 case 25: a block clipped to the first rows keeps only such keys)
            valid = _valid_key_runs(layout, kv_owner, local_len, ring, data)
            found = tuple(b for b in found if intersect_runs(((b.kv_start, b.kv_stop),), valid))
        data.memo[key] = found
    return data.memo[key]


def _rows_between(queries_travel: bool, layout: str, mask: MaskSpec, local_len: int, ring: Ring, data: MaskData,
                  any_pair: bool = False):
    """``rows_between(receiver=, sender=)``: :func:`travelling_rows` of this call, where the pairs with
    this rank (``any_pair``: any pairs, for a rank that relays others' rows) that the runtime data hide
    move nothing; with packed documents or key padding, the rows the pair's data blocks read
    (:func:`burstc.block_geometry.document_travelling_rows`: both sides derive them from the same replicated data).
    ``ring`` needs ``size`` (and ``rank`` unless ``any_pair``)."""
    hidden = pairs_hidden_by_data(layout, mask, local_len, ring.size, **data.host.kernel_args(),
                                  rank=None if any_pair else ring.rank)
    if data.query_rows is not None:
        if queries_travel:
            raise NotImplementedError("a forward over the first query rows has no backward")
        # the key rows the receiver's first rows see: the union of its clipped blocks' keys (both sides derive them)
        rows_between = functools.partial(_clipped_key_rows, layout, mask, local_len=local_len, ring=ring, data=data,
                                         hidden_pairs=hidden)
    elif not mask.runtime_terms or (mask.term(Documents) is not None and not data.packed_documents):
        rows_between = functools.partial(travelling_rows, queries_travel, layout, mask, local_len=local_len,
                                         world_size=ring.size, hidden_pairs=hidden)
    else:  # packed documents or key padding: the rows the pair's data blocks read (a query row that sees only
        # padded keys of the pair does not travel under the burst plan)
        blocks_of = functools.partial(_pair_blocks, layout, mask, local_len=local_len, ring=ring, data=data)
        rows_between = functools.partial(document_travelling_rows, queries_travel, layout, mask,
                                         local_len=local_len, world_size=ring.size, hidden_pairs=hidden,
                                         blocks_of=blocks_of)
    if queries_travel or mask.term(KeyPadding) is None:
        return rows_between
    # K/V travel: a row that is padding in every batch row is seen by no query (the kernels that read a padded key
    # mask it; the flash-style ones run only on blocks whose keys are all valid), so it stays home
    return lambda receiver, sender: intersect_runs(rows_between(receiver=receiver, sender=sender),
                                                   _valid_key_runs(layout, sender, local_len, ring, data))


def _valid_key_runs(layout, owner: int, local_len: int, ring, data: MaskData) -> Runs:
    """The key rows of ``owner`` that are a real token in some batch row (remembered for the call)."""
    key = ("valid_keys", layout, owner, local_len, ring.size)
    if key not in data.memo:
        data.memo[key] = valid_key_runs(layout, owner, local_len, ring.size, data.host.key_valid_BS)
    return data.memo[key]


def _clipped_key_rows(layout: str, mask: MaskSpec, receiver: int, sender: int, local_len: int, ring: Ring,
                      data: MaskData, hidden_pairs: frozenset) -> Runs:
    if (receiver, sender) in hidden_pairs:
        return ()
    return keys_of(_pair_blocks(layout, mask, receiver, sender, local_len, ring, data))


def _positions_of(block: Block, mask: MaskSpec, layout: str, q_owner: int, kv_owner: int, local_len: int,
                  ring: Ring, device) -> tuple[Tensor, Tensor] | None:
    """The block's global ``(q positions, kv positions)`` when it needs the position-masked kernel
    (a :data:`POSITIONS` block, score mods, or runtime terms), else None (the flash-style kernels serve it)."""
    if block.mask != POSITIONS and not mask.score_mods and (block.data_free or not mask.runtime_terms):
        return None
    seq_len = local_len * ring.size
    return (local_positions(seq_len, ring.size, q_owner, layout, device)[block.q_rows],
            local_positions(seq_len, ring.size, kv_owner, layout, device)[block.kv_rows])


def _chunk_positions(block: Block, mask: MaskSpec, layout: str, q_owner: int, kv_owner: int, local_len: int,
                     ring: Ring, device) -> dict:
    """The masked kernel's ``chunk_positions`` argument: the block's positions on the host, where it chooses its
    chunks (none needed when the device is the host)."""
    if host_reads.host_device(device):
        return {}
    return {"chunk_positions": _positions_of(block, mask, layout, q_owner, kv_owner, local_len, ring, "cpu")}


def _flash_forward(block: Block, q_BHSD: Tensor, k_BHSD: Tensor, v_BHSD: Tensor, scale: float):
    """The flash-style kernel of a full, causal or anti-causal block.  Anti-causal (row r sees keys r..): with the
    rows and the keys reversed it is top-left causal, so the causal kernel serves it and its output rows are
    reversed back."""
    if block.mask == ANTI_CAUSAL:
        out_BHSD, lse_BHS = block_attention_forward(q_BHSD.flip(2), k_BHSD.flip(2), v_BHSD.flip(2), True, scale)
        return out_BHSD.flip(2), lse_BHS.flip(2)
    return block_attention_forward(q_BHSD, k_BHSD, v_BHSD, block.causal, scale)


def _flash_backward(block: Block, inputs: tuple, scale: float, lse_grad: bool):
    """:func:`_flash_forward`'s backward: ``inputs`` (dO, q, k, v, lse, delta, out; dim 2 the sequence in each)
    reversed for an anti-causal block, and its gradients reversed back."""
    if block.mask == ANTI_CAUSAL:
        flipped = tuple(None if t is None else t.flip(2) for t in inputs)
        return tuple(grad.flip(2) for grad in block_attention_backward(*flipped, True, scale, lse_grad))
    return block_attention_backward(*inputs, block.causal, scale, lse_grad)


def _record(recorder: CallRecorder, step: int, block: Block, positions, mask: MaskSpec, data: MaskData,
            batch: int, heads_q: int) -> None:
    """Count the block's work: with runtime terms, the entries the data leave visible."""
    visible = None
    if recorder.enabled and mask.runtime_terms and positions is not None:  # else the data hide nothing inside
        visible = int(visible_entries(*positions, mask, **data.kernel_args()).sum())
    recorder.computed(step, block, batch, heads_q, visible)


def _gather_rows(t: Tensor, runs: Runs) -> Tensor:
    """Rows ``runs`` of ``t`` (sequence dim 2: ``[B, H, S, D]`` and ``[B, H, S]`` alike), contiguous."""
    if len(runs) == 1:
        start, stop = runs[0]
        return t[:, :, start:stop].contiguous()  # no copy when it is the whole of a contiguous t
    return torch.cat([t[:, :, start:stop] for start, stop in runs], 2)


def _rows_buffer(like: Tensor, runs: Runs, dtype: torch.dtype | None = None) -> Tensor:
    shape = list(like.shape)
    shape[2] = runs_length(runs)
    return torch.empty(shape, dtype=dtype or like.dtype, device=like.device)


def _scatter_rows_(full: Tensor, runs: Runs, compact: Tensor, add: bool = False) -> None:
    offset = 0
    for start, stop in runs:
        part = compact[:, :, offset:offset + stop - start]
        if add:
            full[:, :, start:stop] += part.to(full.dtype)
        else:
            full[:, :, start:stop].copy_(part)
        offset += stop - start


class _Arrivals:
    """Where a visiting shard's rows are unpacked: two sets of whole-shard buffers used alternately
    (step ``i`` unpacks into set ``i % 2`` while the other is read), zeroed when allocated.  Rows that
    did not travel hold zeros or an earlier visitor's (finite) values; no block reads them as
    visible (the rows that travel are exactly those some entry of the pair needs)."""

    def __init__(self, like: list[Tensor]):
        self._like, self._sets, self._compact = like, [None, None], [None, None]

    def receive_buffers(self, step: int, runs: Runs) -> list[Tensor]:
        """Compact buffers for step ``step``'s arriving rows, reused from two steps before when as long
        (the whole shard arrives into them and is read from them while the next step's arrive)."""
        found = self._compact[step % 2]
        if found is None or found[0].shape[2] != runs_length(runs):
            found = self._compact[step % 2] = [_rows_buffer(t, runs) for t in self._like]
        return found

    def unpack(self, step: int, runs: Runs, compact: list[Tensor]) -> list[Tensor]:
        if runs == ((0, self._like[0].shape[2]),):
            return compact
        slot = self._sets[step % 2]
        if slot is None:
            slot = self._sets[step % 2] = [torch.zeros_like(t) for t in self._like]
        for full, part in zip(slot, compact):
            _scatter_rows_(full, runs, part)
        return slot


def input_transfer(offset: int, out_runs, in_runs, source: list[Tensor] | None, arrivals: _Arrivals, slot: int):
    """``(sends, recvs, in_runs, arriving buffers)`` of one input transfer: rows ``out_runs`` of ``source``
    towards ``+offset``, rows ``in_runs`` from ``-offset`` into ``arrivals``' slot ``slot``; nothing for
    empty runs (both sides of a pair derive the same runs)."""
    if out_runs and source is None:
        raise AssertionError(f"rows {out_runs} must be sent, but none arrived here to send")
    sends = [(offset, [_gather_rows(t, out_runs) for t in source])] if out_runs else []
    arriving = arrivals.receive_buffers(slot, in_runs) if in_runs else None
    return sends, [(-offset, arriving)] if in_runs else [], in_runs, arriving


NO_TRANSFER = ([], [], (), None)


def _step_runs(ring: Ring, rows_between, step: int) -> tuple[Runs, Runs]:
    """``(out_runs, in_runs)`` of compute step ``step``'s input transfer: this rank's own rows that rank + step
    needs there, and what it needs of rank - step's.  Nothing outside ``1 <= step < P``."""
    if not 1 <= step < ring.size:
        return (), ()
    return (rows_between(receiver=(ring.rank + step) % ring.size, sender=ring.rank),
            rows_between(receiver=ring.rank, sender=(ring.rank - step) % ring.size))


def _input_transfers(ring: Ring, rows_between, home: list[Tensor], step: int, arrivals: _Arrivals):
    """:func:`input_transfer` for compute step ``step`` (:func:`_step_runs`)."""
    return input_transfer(step, *_step_runs(ring, rows_between, step), home, arrivals, step)


def known_early(plan: BackwardPlan) -> tuple[int, ...]:
    """Indices of the travelling side (:func:`backward_sides`' order) known before a backward has its ``grad_out``:
    K and V (``kv_ring``: all of it), Q and the LSE (``burst``: dO and delta follow when the backward starts)."""
    return (0, 2) if plan.queries_travel else (0, 1)


class FirstTransfer:
    """A backward loop's first input transfer, posted in parts: the travelling tensors :func:`known_early` (a
    prefetch posts them ahead of the op, :func:`prefetch_backward`) and the rest when the loop starts.  Each part
    is one :meth:`Ring.post_between`, so both sides of a pair post the same parts in the same order; the bytes
    are the unsplit transfer's, counted at the same step."""

    def __init__(self, link: Ring, offset: int, out_runs: Runs, in_runs: Runs, arrivals: _Arrivals, slot: int,
                 step: int, recorder: CallRecorder):
        self.link, self.offset, self.out_runs, self.in_runs = link, offset, out_runs, in_runs
        self.arrivals, self.step, self.recorder = arrivals, step, recorder
        # where this rank's rows arrive (compact), None when none come
        self.arriving = arrivals.receive_buffers(slot, in_runs) if in_runs else None
        self.posted, self.sent = [], set()

    def post(self, source: Sequence[Tensor], indices: Sequence[int]) -> None:
        """Post the tensors ``indices`` of the travelling side: rows ``out_runs`` of ``source`` out, their
        ``in_runs`` in."""
        sends = [(self.offset, [_gather_rows(source[i], self.out_runs) for i in indices])] if self.out_runs else []
        recvs = [(-self.offset, [self.arriving[i] for i in indices])] if self.in_runs else []
        self.posted.append(self.link.post_between(sends, recvs, self.recorder, self.step))
        self.sent.update(indices)

    def post_rest(self, source: Sequence[Tensor]) -> None:
        rest = [i for i in range(len(source)) if i not in self.sent]
        if rest:
            self.post(source, rest)

    def wait(self) -> None:
        for posted in self.posted:
            wait(posted)


def _wait(requests) -> None:
    if isinstance(requests, FirstTransfer):
        requests.wait()
    else:
        wait(requests)


def _flat_first_transfer(ring: Ring, rows_between, like: list[Tensor], recorder: CallRecorder) -> FirstTransfer:
    """Compute step 1's input transfer (:func:`_step_runs`) as a :class:`FirstTransfer`, counted at step 0."""
    return FirstTransfer(ring, 1, *_step_runs(ring, rows_between, 1), _Arrivals(like), 1, 0, recorder)


def first_backward_transfer(plan: BackwardPlan, ring: Ring | TwoLevelRing, layout: str, mask: MaskSpec,
                            local_len: int, data: MaskData, like: list[Tensor], recorder: CallRecorder
                            ) -> FirstTransfer:
    """The first transfer of a backward loop over ``ring`` (flat: step 1's; double ring: the first lane's, over the
    inter-node link), nothing posted yet.  ``like``: the travelling side's tensors or stand-ins of their shapes
    and dtypes."""
    if isinstance(ring, TwoLevelRing):
        from burstc.ops.double_ring import lane_first_transfer

        return lane_first_transfer(plan, ring, layout, mask, local_len, data, like, recorder)
    return _flat_first_transfer(ring, _rows_between(plan.queries_travel, layout, mask, local_len, ring, data), like,
                                recorder)


@dataclasses.dataclass
class PrefetchedBackward:
    """A backward's first transfer posted ahead of it (its known-early tensors, for the call's first loop): what
    :func:`start_ring_backward` continues from."""

    plan: str
    recorder: CallRecorder
    first: FirstTransfer
    q_heads: slice
    kv_heads: slice
    back: Callable[[], None]
    """Ends the time away (:meth:`CallRecorder.leave`): from the prefetch to the backward's start the graph's other
    work runs, and it hides the prefetched transfer as the call's own compute would."""


def prefetch_backward(plan_name: str, q_BHSD: Tensor, k_BHSD: Tensor, v_BHSD: Tensor, lse_BHS: Tensor, ring,
                      layout: str, mask: MaskSpec, data: MaskData) -> PrefetchedBackward | None:
    """Post the first transfer of the backward's first loop (head group and batch group) for the tensors known
    before ``grad_out`` exists (:func:`known_early`); None on the hybrid (Ulysses) ring, whose exchanges are
    all-to-alls inside its own function."""
    if isinstance(ring, UlyssesRing):
        return None
    plan = BACKWARD_PLANS[plan_name]
    recorder = CallRecorder("backward", plan_name, ring, layout, mask.encode(), q_BHSD, k_BHSD)
    lse_BHS = lse_BHS.to(ACC_DTYPE).contiguous()
    pieces = _call_pieces(data, (q_BHSD, k_BHSD, v_BHSD, lse_BHS), ring, mask, recorder)
    group, (q, k, v, lse), q_heads, kv_heads = next(pieces)
    pieces.close()  # the backward splits the call again (and records the split) when it starts
    if plan.queries_travel:  # dO like q (cast to q's dtype), delta like the fp32 lse: stand-ins for their buffers
        like = [q[:, q_heads].contiguous(), q[:, q_heads], lse[:, q_heads], lse[:, q_heads]]
    else:
        like = [k[:, kv_heads].contiguous(), v[:, kv_heads].contiguous()]
    first = first_backward_transfer(plan, ring, layout, mask, q.shape[2], group.data, like, recorder)
    first.post(like, known_early(plan))
    return PrefetchedBackward(plan_name, recorder, first, q_heads, kv_heads, recorder.leave())


class _Accumulator:
    """A rank's running ``(out, lse)`` in fp32 over the blocks merged so far (None before the first)."""

    def __init__(self, q_BHSD: Tensor, mask: MaskSpec, data: MaskData):
        self.out = self.lse = None
        # runtime terms: rows may see nothing in a block, or anywhere; a window: the own pair is several blocks;
        # a forward over the first rows: the others see nothing
        self.starts_empty = bool(mask.runtime_terms) or mask.term(SlidingWindow) is not None or \
            data.query_rows is not None
        if self.starts_empty:
            batch, heads_q, local_len, head_dim = q_BHSD.shape
            if data.query_rows is not None:  # only the first rows: the result holds just them
                local_len = data.query_rows
            self.out = torch.zeros(batch, heads_q, local_len, head_dim, dtype=ACC_DTYPE, device=q_BHSD.device)
            self.lse = torch.full((batch, heads_q, local_len), float("-inf"), dtype=ACC_DTYPE, device=q_BHSD.device)

    def result(self, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
        return self.out.to(dtype).contiguous(), self.lse.contiguous()


def attend_forward(q_BHSD: Tensor, kv_cur: list[Tensor] | None, kv_owner: int, acc: _Accumulator, ring, layout: str,
                   mask: MaskSpec, scale: float, data: MaskData, recorder: CallRecorder, step: int) -> None:
    """Compute step ``step`` of a forward: this rank's queries against ``kv_cur`` (rank ``kv_owner``'s K/V,
    None when none of its rows travelled here), merged into ``acc``.  ``ring`` gives the sequence
    geometry (``size`` and this rank's ``rank`` in the sequence order), whatever moved the data."""
    with recorder.step(step, ring.rank, kv_owner):
        _attend_forward_blocks(q_BHSD, kv_cur, kv_owner, acc, ring, layout, mask, scale, data, recorder, step)


def _attend_forward_blocks(q_BHSD, kv_cur, kv_owner, acc, ring, layout, mask, scale, data, recorder, step) -> None:
    batch, heads_q, local_len, _ = q_BHSD.shape
    rank = ring.rank
    for block in _pair_blocks(layout, mask, rank, kv_owner, local_len, ring, data):
        if kv_cur is None:
            raise AssertionError(f"block {block} of pair ({rank}, {kv_owner}), but no key rows travelled")
        q_blk, k_blk, v_blk = q_BHSD[:, :, block.q_rows], *(t[:, :, block.kv_rows] for t in kv_cur)
        positions = _positions_of(block, mask, layout, rank, kv_owner, local_len, ring, q_BHSD.device)
        if positions is None:
            out_blk, lse_blk = _flash_forward(block, q_blk, k_blk, v_blk, scale)
        else:
            out_blk, lse_blk = masked_block_forward(q_blk, k_blk, v_blk, *positions, mask, scale,
                                                    **data.kernel_args(), **_chunk_positions(
                                                        block, mask, layout, rank, kv_owner, local_len, ring,
                                                        q_BHSD.device))
        _record(recorder, step, block, positions, mask, data, batch, heads_q)
        if acc.starts_empty:
            rows = block.q_rows
            merge_attention_block_or_empty_(acc.out[:, :, rows], acc.lse[:, :, rows], out_blk, lse_blk)
        elif acc.out is None:
            # The first block (step 0, the own diagonal one) starts the accumulators: it must
            # cover every query row, as the merge has no -inf start (blocks() keeps the own pair of a
            # static mask one block, and every row sees its diagonal).
            if (block.q_start, block.q_stop) != (0, local_len):
                raise NotImplementedError(f"first block {block} does not cover all {local_len} query rows")
            acc.out, acc.lse = out_blk.to(ACC_DTYPE), lse_blk
        else:
            merge_attention_block_(acc.out[:, :, block.q_rows], acc.lse[:, :, block.q_rows], out_blk, lse_blk)


def _call_pieces(data: MaskData, inputs: Sequence[Tensor | None], ring: Ring, mask: MaskSpec,
                 recorder: CallRecorder) -> Iterator[tuple[BatchGroup, list[Tensor | None], slice, slice]]:
    """The pieces a ring call runs as, one loop each: ``(batch group, its rows of inputs, query heads, K/V
    heads)`` for each batch group (:mod:`burstc.ops.batch_groups`) and each of its head groups
    (:mod:`burstc.ops.head_groups`).  ``inputs`` start with the call's ``q``, ``k`` (None entries stay None)."""
    groups = batch_row_groups(data, inputs[0].shape[0])
    head_groups = 0
    for group in groups:
        taken = [take_rows(t, group.rows) for t in inputs]
        slices = call_head_slices(taken[0], taken[1], ring.size, bool(mask.score_mods))
        head_groups = max(head_groups, len(slices))
        for q_heads, kv_heads in slices:
            yield group, taken, q_heads, kv_heads
    recorder.split(len(groups), head_groups)


def ring_forward(q_BHSD: Tensor, k_BHSD: Tensor, v_BHSD: Tensor, ring: Ring, layout: str, mask: MaskSpec,
                 scale: float, data: MaskData = MaskData()) -> tuple[Tensor, Tensor]:
    """This rank's ``(out in q.dtype, lse_BHS fp32)`` rows of attention over the whole ring, run as a pipeline of
    head groups (:mod:`burstc.ops.head_groups`)."""
    if isinstance(ring, UlyssesRing):
        from burstc.ops.ulysses import ulysses_ring_forward

        return ulysses_ring_forward(q_BHSD, k_BHSD, v_BHSD, ring, layout, mask, scale, data)
    loop = _forward_loop
    if isinstance(ring, TwoLevelRing):
        from burstc.ops.double_ring import double_ring_forward_loop as loop
    recorder = CallRecorder("forward", None, ring, layout, mask.encode(), q_BHSD, k_BHSD)
    loops, places, batch_rows = [], [], []
    for group, (q, k, v), q_heads, kv_heads in _call_pieces(data, (q_BHSD, k_BHSD, v_BHSD), ring, mask, recorder):
        loops.append(loop(q[:, q_heads], k[:, kv_heads], v[:, kv_heads], ring, layout, mask, scale, group.data,
                          recorder))
        places.append((q_heads, q_heads))
        batch_rows.append(group.rows)
    outputs = None
    if len(loops) > 1:
        batch, heads_q, local_len, head_dim = q_BHSD.shape
        rows = local_len if data.query_rows is None else data.query_rows
        outputs = (q_BHSD.new_empty(batch, heads_q, rows, head_dim),
                   torch.empty(batch, heads_q, rows, dtype=ACC_DTYPE, device=q_BHSD.device))
    result = run_pipelined(loops, outputs, places, batch_rows)
    recorder.publish()
    return result


def _forward_loop(q_BHSD: Tensor, k_BHSD: Tensor, v_BHSD: Tensor, ring: Ring, layout: str, mask: MaskSpec,
                  scale: float, data: MaskData, recorder: CallRecorder) -> GroupLoop:
    """The forward over a flat ring, in the three parts of :data:`burstc.ops.head_groups.GroupLoop`."""
    local_len = q_BHSD.shape[2]
    size, rank = ring.size, ring.rank
    kv_home = [k_BHSD.contiguous(), v_BHSD.contiguous()]
    rows_between = _rows_between(False, layout, mask, local_len, ring, data)
    arrivals = _Arrivals(kv_home)
    acc = _Accumulator(q_BHSD, mask, data)
    sends, recvs, next_runs, arriving = _input_transfers(ring, rows_between, kv_home, 1, arrivals)
    requests = ring.post_between(sends, recvs, recorder, 0)
    yield
    kv_cur = kv_home
    for step in range(size):
        if step > 0:
            sends, recvs, next_runs, arriving = _input_transfers(ring, rows_between, kv_home, step + 1, arrivals)
            requests = ring.post_between(sends, recvs, recorder, step)
        attend_forward(q_BHSD, kv_cur, (rank - step) % size, acc, ring, layout, mask, scale, data, recorder, step)
        wait(requests)
        kv_cur = arrivals.unpack(step + 1, next_runs, arriving) if arriving is not None else None
    yield
    return acc.result(q_BHSD.dtype)


def ring_backward(plan: str, grad_out_BHSD: Tensor, q_BHSD: Tensor, k_BHSD: Tensor, v_BHSD: Tensor,
                  out_BHSD: Tensor, lse_BHS: Tensor, grad_lse_BHS: Tensor | None, ring: Ring, layout: str,
                  mask: MaskSpec, scale: float, data: MaskData = MaskData()) -> tuple[Tensor, Tensor, Tensor]:
    """``(dq, dk, dv)`` of this rank's shards, contiguous in the inputs' dtypes, with backward ``plan``."""
    return start_ring_backward(plan, grad_out_BHSD, q_BHSD, k_BHSD, v_BHSD, out_BHSD, lse_BHS, grad_lse_BHS, ring,
                               layout, mask, scale, data)()


def start_ring_backward(plan: str, grad_out_BHSD: Tensor, q_BHSD: Tensor, k_BHSD: Tensor, v_BHSD: Tensor,
                        out_BHSD: Tensor, lse_BHS: Tensor, grad_lse_BHS: Tensor | None, ring: Ring, layout: str,
                        mask: MaskSpec, scale: float, data: MaskData = MaskData(),
                        prefetched: PrefetchedBackward | None = None) -> Callable[[], tuple[Tensor, Tensor, Tensor]]:
    """:func:`ring_backward` up to its last hop (the last visitor's gradients going home), posted and not waited
    for; the returned function waits for it and returns ``(dq, dk, dv)``.  The hybrid (Ulysses) ring runs whole
    here (its last exchange is an all-to-all inside its own function).  ``prefetched``: the first loop's first
    transfer, partly posted ahead of the call (:func:`prefetch_backward`, same plan and inputs)."""
    if isinstance(ring, UlyssesRing):
        from burstc.ops.ulysses import ulysses_ring_backward

        grads = ulysses_ring_backward(plan, grad_out_BHSD, q_BHSD, k_BHSD, v_BHSD, out_BHSD, lse_BHS, grad_lse_BHS,
                                      ring, layout, mask, scale, data)
        return lambda: grads
    grad_out_BHSD = grad_out_BHSD.to(q_BHSD.dtype).contiguous()
    lse_BHS = lse_BHS.to(ACC_DTYPE).contiguous()
    # An lse gradient g adds P * g to d(scores): the same as using delta - g (only delta changes).
    lse_has_grad = grad_lse_BHS is not None and bool(grad_lse_BHS.ne(0).any())
    if prefetched is not None and prefetched.plan != plan:
        raise AssertionError(f"a backward prefetched for plan {prefetched.plan!r} started with plan {plan!r}")
    if prefetched is None:
        recorder = CallRecorder("backward", plan, ring, layout, mask.encode(), q_BHSD, k_BHSD)
    else:
        recorder = prefetched.recorder
        prefetched.back()
    if BACKWARD_PLANS[plan].queries_travel:  # delta travels with the queries
        delta_BHS = attention_delta(out_BHSD, grad_out_BHSD)
        if lse_has_grad:
            delta_BHS = delta_BHS - grad_lse_BHS.to(ACC_DTYPE)
        delta_BHS = delta_BHS.contiguous()
    else:  # the kernels read delta from the resident ``out``, unless an lse gradient adjusts it
        delta_BHS = attention_delta(out_BHSD, grad_out_BHSD) - grad_lse_BHS.to(ACC_DTYPE) if lse_has_grad else None
    # ``out`` is only right for the kernel where delta is not adjusted; else a stand-in carries delta.
    out_BHSD = None if lse_has_grad else out_BHSD
    if lse_has_grad:
        data = dataclasses.replace(data, lse_grad=True)
    loop = _backward_loop
    if isinstance(ring, TwoLevelRing):
        from burstc.ops.double_ring import double_ring_backward_loop as loop
    def heads(t: Tensor | None, selected: slice) -> Tensor | None:
        return None if t is None else t[:, selected]

    loops, places, batch_rows = [], [], []
    inputs = (q_BHSD, k_BHSD, v_BHSD, grad_out_BHSD, out_BHSD, lse_BHS, delta_BHS)
    for group, (q, k, v, grad_out, out, lse, delta), q_heads, kv_heads in _call_pieces(data, inputs, ring, mask,
                                                                                       recorder):
        first = None
        if prefetched is not None and not loops:
            if (prefetched.q_heads, prefetched.kv_heads) != (q_heads, kv_heads):
                raise AssertionError(f"a backward prefetched for heads {prefetched.q_heads}, {prefetched.kv_heads} "
                                     f"started with {q_heads}, {kv_heads}")
            first = prefetched.first
        loops.append(loop(BACKWARD_PLANS[plan], grad_out[:, q_heads], q[:, q_heads], k[:, kv_heads],
                          v[:, kv_heads], heads(out, q_heads), lse[:, q_heads], heads(delta, q_heads), ring,
                          layout, mask, scale, recorder, group.data, first))
        places.append((q_heads, kv_heads, kv_heads))
        batch_rows.append(group.rows)
    outputs = None
    if len(loops) > 1:
        outputs = tuple(torch.empty(t.shape, dtype=t.dtype, device=t.device) for t in (q_BHSD, k_BHSD, v_BHSD))
    finish_loops = start_pipelined(loops, outputs, places, batch_rows)
    back = recorder.leave()

    def finish() -> tuple[Tensor, Tensor, Tensor]:
        back()
        grads = finish_loops()
        recorder.publish()
        return tuple(g.contiguous() for g in grads)

    return finish


def _rows(grad: int, block: Block) -> slice:
    return block.q_rows if grad == _DQ else block.kv_rows


def _add_rows_(acc: Tensor, rows: slice, part: Tensor) -> None:
    acc[:, :, rows] += part.to(acc.dtype)


def attend_backward(plan: BackwardPlan, travelling: list[Tensor] | None, home: list[Tensor], q_owner: int,
                    kv_owner: int, out: Tensor | None, grads: tuple[Tensor, Tensor, Tensor],
                    partial: list[Tensor] | None, ring, layout: str, mask: MaskSpec, scale: float, data: MaskData,
                    recorder: CallRecorder, step: int) -> None:
    """Compute step ``step`` of a backward: the blocks of pair (``q_owner``, ``kv_owner``), one of them this
    rank.  ``travelling``: the visitor's side (None when none of its rows travelled here), ``home`` this
    rank's other side; the home side's gradients add into ``grads``, the travelling side's into ``partial``
    (``plan.travelling_grads`` order).  ``out``: this rank's own output, read only for its own queries."""
    with recorder.step(step, q_owner, kv_owner):
        _attend_backward_blocks(plan, travelling, home, q_owner, kv_owner, out, grads, partial, ring, layout, mask,
                                scale, data, recorder, step)


def _attend_backward_blocks(plan, travelling, home, q_owner, kv_owner, out, grads, partial, ring, layout, mask, scale,
                            data, recorder, step) -> None:
    batch, heads_q, local_len, _ = grads[_DQ].shape  # q's shape
    own_out = out if q_owner == ring.rank else None
    for block in _pair_blocks(layout, mask, q_owner, kv_owner, local_len, ring, data):
        if travelling is None:
            raise AssertionError(f"block {block} of pair ({q_owner}, {kv_owner}), but no rows travelled")
        (q_cur, grad_out_cur, lse_cur, delta_cur), (k_cur, v_cur) = (
            (travelling, home) if plan.queries_travel else (home, travelling))
        rows, cols = block.q_rows, block.kv_rows
        inputs = (grad_out_cur[:, :, rows], q_cur[:, :, rows], k_cur[:, :, cols], v_cur[:, :, cols],
                  lse_cur[:, :, rows], None if delta_cur is None else delta_cur[:, :, rows],
                  None if own_out is None else own_out[:, :, rows])
        positions = _positions_of(block, mask, layout, q_owner, kv_owner, local_len, ring, grads[_DQ].device)
        if positions is None:
            block_grads = _flash_backward(block, inputs, scale, data.lse_grad)
        else:
            block_grads = masked_block_backward(*inputs, *positions, mask, scale, **data.kernel_args(),
                                                **_chunk_positions(block, mask, layout, q_owner, kv_owner, local_len,
                                                                   ring, grads[_DQ].device))
        _record(recorder, step, block, positions, mask, data, batch, heads_q)
        for i in plan.home_grads:
            _add_rows_(grads[i], _rows(i, block), block_grads[i])
        for acc, i in zip(partial, plan.travelling_grads):
            _add_rows_(acc, _rows(i, block), block_grads[i])


def backward_sides(plan: BackwardPlan, grad_out, q, k, v, lse, delta):
    """``(fp32 zero (dq, dk, dv), the travelling side, the side at home)`` of a backward loop."""
    grads = (torch.zeros(q.shape, dtype=ACC_DTYPE, device=q.device),
             torch.zeros(k.shape, dtype=ACC_DTYPE, device=k.device))
    grads += (torch.zeros_like(grads[_DK]),)
    if plan.queries_travel:
        return grads, [q.contiguous(), grad_out, lse, delta], [k, v]
    return grads, [k.contiguous(), v.contiguous()], [q, grad_out, lse, delta]


def _backward_loop(plan: BackwardPlan, grad_out, q, k, v, out, lse, delta, ring: Ring, layout: str,
                   mask: MaskSpec, scale: float, recorder: CallRecorder, data: MaskData,
                   first: FirstTransfer | None = None) -> GroupLoop:
    """The one backward loop, in the three parts of :data:`burstc.ops.head_groups.GroupLoop`; returns
    ``(dq, dk, dv)`` in the inputs' dtypes.  At step i the travelling side held here belongs to rank (rank - i).

    Gradients of the side at home accumulate at home as blocks are computed; those of the travelling
    side go into the visitor's partial gradients (this rank's own at step 0), whose travelled rows go
    back to the visitor at the next step (the last visitor's in one extra hop), where they are added.
    """
    size, rank = ring.size, ring.rank
    local_len = q.shape[2]
    grads, home_travelling, home = backward_sides(plan, grad_out, q, k, v, lse, delta)
    own_travelling_grads = [grads[i] for i in plan.travelling_grads]
    rows_between = _rows_between(plan.queries_travel, layout, mask, local_len, ring, data)
    if first is None:  # (else its known-early part was posted ahead of the call)
        first = _flat_first_transfer(ring, rows_between, home_travelling, recorder)
    first.post_rest(home_travelling)
    arrivals, next_runs, arriving = first.arrivals, first.in_runs, first.arriving
    travelling, previous = home_travelling, None  # previous: (step, its visitor's partial gradients)
    requests = first  # step 0 returns nothing
    returned = ((), None)
    yield
    for step in range(size):
        visitor = (rank - step) % size  # owner of the travelling side held now
        q_owner, kv_owner = (visitor, rank) if plan.queries_travel else (rank, visitor)
        if step > 0:
            sends, recvs, next_runs, arriving = _input_transfers(ring, rows_between, home_travelling, step + 1,
                                                                 arrivals)
            back_sends, back_recvs, returned = _return_transfers(ring, rows_between, step - 1, previous,
                                                                 own_travelling_grads)
            requests = ring.post_between(sends + back_sends, recvs + back_recvs, recorder, step)
        partial = None
        if step == 0:
            partial = own_travelling_grads
        elif travelling is not None:  # what travelled here goes back, even where the data hide it all
            partial = fp32_zeros_like(own_travelling_grads)
        attend_backward(plan, travelling, home, q_owner, kv_owner, out, grads, partial, ring, layout, mask, scale,
                        data, recorder, step)
        _wait(requests)
        _add_returned_(returned, own_travelling_grads)
        previous = partial if step > 0 else None
        travelling = arrivals.unpack(step + 1, next_runs, arriving) if arriving is not None else None
    last_hop, returned = [], ((), None)
    if size > 1:  # the last visitor's gradients go home
        back_sends, back_recvs, returned = _return_transfers(ring, rows_between, size - 1, previous,
                                                             own_travelling_grads)
        last_hop = ring.post_between(back_sends, back_recvs, recorder, size)
    yield
    wait(last_hop)
    _add_returned_(returned, own_travelling_grads)
    return grads[_DQ].to(q.dtype), grads[_DK].to(k.dtype), grads[_DV].to(v.dtype)


def return_transfer(offset: int, out_runs, partial: list[Tensor] | None, in_runs, like: list[Tensor]):
    """``(sends, recvs, (in_runs, buffers))`` of one gradient return: rows ``out_runs`` of ``partial`` towards
    ``+offset`` (nothing when ``partial`` is None: no rows came), fp32 buffers shaped like ``like`` for rows
    ``in_runs`` from ``-offset``."""
    sends = [(offset, [_gather_rows(g, out_runs) for g in partial])] if partial is not None and out_runs else []
    if not in_runs:
        return sends, [], ((), None)
    buffers = [_rows_buffer(g, in_runs, ACC_DTYPE) for g in like]
    return sends, [(-offset, buffers)], (in_runs, buffers)


def _return_transfers(ring: Ring, rows_between, step: int, partial: list[Tensor] | None, own_grads: list[Tensor]):
    """:func:`return_transfer` of the travelling side's gradients of compute step ``step`` (>= 1; nothing for
    0): this rank sends ``partial``, the gradients of the rows it received from rank - step, back there, and
    receives its own rows' gradients from rank + step.  ``partial`` is None exactly when no rows came."""
    if step < 1:
        return [], [], ((), None)
    return return_transfer(-step, rows_between(receiver=ring.rank, sender=(ring.rank - step) % ring.size), partial,
                           rows_between(receiver=(ring.rank + step) % ring.size, sender=ring.rank), own_grads)


def fp32_zeros_like(like: list[Tensor]) -> list[Tensor]:
    """Fresh fp32 gradient partials shaped like ``like``."""
    return [torch.zeros(t.shape, dtype=ACC_DTYPE, device=t.device) for t in like]


def _add_returned_(returned, own_grads: list[Tensor]) -> None:
    runs, buffers = returned
    if buffers is not None:
        for grad, part in zip(own_grads, buffers):
            _scatter_rows_(grad, runs, part, add=True)
