"""BurstAttention ring attention over a sequence-parallel process group: the op and its public API.

Every rank holds ``S/P`` tokens of q, k and v (SDPA layout ``[B, H, S_local, D]``) in the order
given by :func:`burstc.layout.local_positions`.  The result on each rank equals that rank's rows of
single-device ``F.scaled_dot_product_attention(q, k, v, <mask>, scale=scale, enable_gqa=True)``.

The work runs as ``torch.library.custom_op``s (``burstc::ring_attention_forward`` /
``burstc::ring_attention_backward``) that take a sequence-parallel spec: one process-group name per
sequence-parallel mesh dim (one today) and the mask as ``MaskSpec.encode()``, so they work eagerly
and inside ``torch.compile(fullgraph=True)``.  Runtime mask terms take their data as optional tensor
inputs, ``doc_ids`` (``Documents``) and ``key_valid`` (``KeyPadding``), ``[B, S_global]`` in global
order: the model's token inputs are replicated, so every rank holds the whole batch's data and the op
needs no communication for it.  Given exactly when the spec has the term.  A query row that sees no
key at all gets out 0, lse -inf and zero gradients: what single-device SDPA returns for a fully
masked row (its safe softmax), and HF's convention for padded rows.  The pieces:

* :mod:`burstc.ops.ring_loops`: the forward loop and the one backward loop (plans ``kv_ring`` and
  ``burst``; :mod:`burstc.planner` picks for ``"auto"``), sending each pair only the rows it needs;
* :mod:`burstc.block_geometry`: which blocks of a (query shard, key shard) pair the mask leaves, and
  which rows of a pair travel (:func:`~burstc.block_geometry.travelling_rows`);
* :mod:`burstc.kernels.attention_blocks`: the block kernels;
* :mod:`burstc.ops.lse_merge`: the LSE convention (fp32, natural log of the scaled scores,
  ``[B, H, S]`` contiguous), the merge, delta;
* :mod:`burstc.ops.ring_comm`: the ring over one process group;
* :mod:`burstc.ops.ring_stats`: :func:`record_stats`, the byte and work counters.
"""
from __future__ import annotations

import dataclasses
from typing import Callable, Sequence

import torch
import torch.distributed as dist
from torch import Tensor

from burstc.attention_ir import Documents, KeyPadding, MaskSpec
from burstc.layout import DOCUMENTS, ChunkLayout, check_layout, resolve_layout
from burstc.ops.autocast import cast_like_lower_precision, register_lower_precision, without_autocast
from burstc.block_geometry import check_executable
from burstc.ops import host_reads
from burstc.ops.hidden_rows import add_uniform_rows_, local_hidden_rows, uniform_rows_grads
from burstc.ops.lse_merge import ACC_DTYPE
from burstc.ops.ring_comm import Ring, TwoLevelRing, UlyssesRing, resolve_group
from burstc.ops.ring_loops import BACKWARD_PLANS, MaskData, prefetch_backward, ring_forward, start_ring_backward
from burstc.ops.ring_stats import RingCallStats, RingStats, record_stats  # noqa: F401  (public API)

PLANS = tuple(BACKWARD_PLANS)  # ("kv_ring", "burst")
PLAN_CHOICES = ("auto",) + PLANS
SUPPORTED_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def resolve_plan(plan: str, q: Tensor, k: Tensor, world_size: int, layout: str = "zigzag",
                 mask: MaskSpec | None = None) -> str:
    """``"auto"`` -> the planner's cheaper backward for this call's shapes, layout and mask (the rows
    its mask-aware transfers send; causal by default); else ``plan``."""
    if plan != "auto":
        return plan
    from burstc.planner import cheaper_backward, predicted_transfers

    batch, heads_q, local_len, head_dim = q.shape
    mask = MaskSpec.causal() if mask is None else mask
    return cheaper_backward(predicted_transfers(layout, mask.static_part, local_len * world_size, world_size, batch,
                                                heads_q, k.shape[1], head_dim, q.element_size()))


# ---------------------------------------------------------------------------------------------
# Custom ops


def _ring_of(group_names: Sequence[str]) -> Ring | TwoLevelRing | UlyssesRing:
    """The ring of a sequence-parallel spec: one group name (a flat ring over it), or two, ``[inter, intra]``
    (a double ring: the lanes across nodes and this node's ranks, both of at least 2 ranks)."""
    if len(group_names) == 1:
        return Ring(resolve_group(group_names[0]))
    if len(group_names) == 3 and group_names[0] == UlyssesRing.ULYSSES:
        return UlyssesRing(*(resolve_group(name) for name in group_names[1:]))
    if len(group_names) == 2:
        ring = TwoLevelRing(*(resolve_group(name) for name in group_names))
        if ring.nodes < 2 or ring.per_node < 2:
            raise ValueError(f"a double ring needs at least 2 nodes of at least 2 ranks, got {ring.nodes} x "
                             f"{ring.per_node}; use a flat ring (one group name)")
        return ring
    raise NotImplementedError(f"ring attention runs over one process group (a flat ring), two (inter-node and "
                              f"intra-node: a double ring) or 'ulysses' and two (intra-node all-to-all, inter-node "
                              f"ring), got {len(group_names)}: {list(group_names)}")


# Explicit schemas: ``str[]`` (one group name per sequence-parallel mesh dim) is not inferred from hints.
# The runtime mask data come last, defaulting to None: a static-mask call reads as before.  ``uniform_rows_keys``
# n > 0: a query row whose every key is hidden gets eager's uniform average over the first n keys (a model that
# fills hidden scores with finfo.min; :mod:`burstc.ops.hidden_rows`), not 0; ``uniform_rows_score_grad`` False: the
# model replaced those scores (masked_fill), so q and k get no gradient through them.
# ``chunk_owners`` ([C] int64): the call's chunk owners, given exactly for layout "documents" (burstc.layout).
_MASK_DATA_ARGS = "Tensor? doc_ids=None, Tensor? key_valid=None, int uniform_rows_keys=0, " \
                  "bool uniform_rows_score_grad=True, Tensor? chunk_owners=None"
# ``query_rows`` in [0, S_local) (forward only): only each rank's first ``query_rows`` query rows are computed and
# returned (out ``[B, Hq, query_rows, D]``), and only the key rows they see travel: a checkpoint's recompute of the
# rows it did not keep (:mod:`burstc.kept_rows`).  Not differentiable.
_FORWARD_SCHEMA = "(Tensor q, Tensor k, Tensor v, str[] group_names, str layout, str mask, float scale, str plan," \
                  f" {_MASK_DATA_ARGS}, int query_rows=-1) -> (Tensor, Tensor)"
# ``prefetched`` (backward): the token of a ``burstc::ring_attention_backward_prefetch`` of the same call, which
# posted the first transfer's tensors known before ``grad_out`` (the ``prefetch_ring_backward`` pass).
_BACKWARD_SCHEMA = "(Tensor grad_out, Tensor q, Tensor k, Tensor v, Tensor out, Tensor lse, Tensor? grad_lse," \
                   f" str[] group_names, str layout, str mask, float scale, str plan, {_MASK_DATA_ARGS}," \
                   " Tensor? prefetched=None) -> (Tensor, Tensor, Tensor)"
_PREFETCH_SCHEMA = "(Tensor q, Tensor k, Tensor v, Tensor lse, str[] group_names, str layout, str mask, float scale," \
                   f" str plan, {_MASK_DATA_ARGS}) -> Tensor"


class MissingMaskData(ValueError, NotImplementedError):
    """A runtime mask term without its data, or data without the term.  Also a NotImplementedError:
    what the op raised for these terms before it executed them, so existing handlers still catch it."""


def _check_data_present(mask: MaskSpec, doc_ids: Tensor | None, key_valid: Tensor | None) -> None:
    for term, name, data in ((Documents, "doc_ids", doc_ids), (KeyPadding, "key_valid", key_valid)):
        if (mask.term(term) is not None) != (data is not None):
            raise MissingMaskData(
                f"{name}= is given exactly when the mask has a {term.__name__} term: mask {mask.encode()!r}, "
                f"{name} {'missing' if data is None else 'given'}")


def _mask_data(mask: MaskSpec, doc_ids: Tensor | None, key_valid: Tensor | None, batch: int, seq_len: int,
               device) -> MaskData:
    """Check that the data match the spec's runtime terms (``[B, S_global]``: integer document ids,
    bool key validity) and bundle them for the loops."""
    _check_data_present(mask, doc_ids, key_valid)
    for name, data in (("doc_ids", doc_ids), ("key_valid", key_valid)):
        if data is None:
            continue
        if tuple(data.shape) != (batch, seq_len):
            raise ValueError(f"{name} must be [B, S_global] = [{batch}, {seq_len}], got {tuple(data.shape)}")
        if data.device != device:
            raise ValueError(f"{name} must be on {device}, got {data.device}")
    if doc_ids is not None and (doc_ids.is_floating_point() or doc_ids.is_complex()):
        raise TypeError(f"doc_ids must be integer ids, got {doc_ids.dtype}")
    if key_valid is not None and key_valid.dtype != torch.bool:
        raise TypeError(f"key_valid must be bool (True where the key is a real token), got {key_valid.dtype}")
    return MaskData(doc_ids, key_valid)


@torch.library.custom_op("burstc::ring_attention_forward", mutates_args=(), schema=_FORWARD_SCHEMA)
@without_autocast
def _ring_attention_forward_op(q: Tensor, k: Tensor, v: Tensor, group_names: list[str], layout: str, mask: str,
                               scale: float, plan: str, doc_ids: Tensor | None = None,
                               key_valid: Tensor | None = None, uniform_rows_keys: int = 0,
                               uniform_rows_score_grad: bool = True, chunk_owners: Tensor | None = None,
                               query_rows: int = -1) -> tuple[Tensor, Tensor]:
    # ``plan`` is unused here; it rides along so that the autograd context has it.
    ring, spec = _ring_of(group_names), MaskSpec.decode(mask)
    layout = resolve_layout(layout, chunk_owners, q.shape[2] * ring.size)
    data = _mask_data(spec, doc_ids, key_valid, q.shape[0], q.shape[2] * ring.size, q.device)
    if 0 <= query_rows < q.shape[2]:
        if isinstance(ring, UlyssesRing) or uniform_rows_keys > 0:
            raise NotImplementedError("a forward over the first query rows runs on a flat or double ring, with "
                                      "hidden rows left at 0")
        data = dataclasses.replace(data, query_rows=query_rows)
    out, lse = ring_forward(q, k, v, ring, layout, spec, scale, data)
    rows = _uniform_rows(spec, data, uniform_rows_keys, layout, ring, q.shape[2], q.device)
    if rows is not None:
        add_uniform_rows_(out, v, rows, uniform_rows_keys, ring)
    return out, lse


def _uniform_rows(spec: MaskSpec, data: MaskData, keys: int, layout: str, ring, local_len: int, device):
    """This rank's rows of eager's uniform hidden rows (``uniform_rows_keys``) for this call, or None."""
    if keys <= 0:
        return None
    if not 0 < keys <= local_len * ring.size:
        raise ValueError(f"uniform_rows_keys must be in (0, {local_len * ring.size}], got {keys}")
    host = data.host  # decided on the host copy of the mask data (burstc.ops.host_reads)
    return local_hidden_rows(spec, host.doc_ids_BS, host.key_valid_BS, keys, layout, ring.rank, ring.size, local_len,
                             device=device)


@_ring_attention_forward_op.register_fake
def _(q, k, v, group_names, layout, mask, scale, plan, doc_ids=None, key_valid=None, uniform_rows_keys=0,
      uniform_rows_score_grad=True, chunk_owners=None, query_rows=-1):
    batch, heads_q, local_len, head_dim = q.shape
    rows = query_rows if 0 <= query_rows < local_len else local_len
    return q.new_empty((batch, heads_q, rows, head_dim)), q.new_empty((batch, heads_q, rows), dtype=ACC_DTYPE)


@torch.library.custom_op("burstc::ring_attention_backward", mutates_args=(), schema=_BACKWARD_SCHEMA)
@without_autocast
def _ring_attention_backward_op(grad_out: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor,
                                grad_lse: Tensor | None, group_names: list[str], layout: str, mask: str,
                                scale: float, plan: str, doc_ids: Tensor | None = None,
                                key_valid: Tensor | None = None, uniform_rows_keys: int = 0,
                                uniform_rows_score_grad: bool = True, chunk_owners: Tensor | None = None,
                                prefetched: Tensor | None = None) -> tuple[Tensor, Tensor, Tensor]:
    return _start_backward(grad_out, q, k, v, out, lse, grad_lse, group_names, layout, mask, scale, plan, doc_ids,
                           key_valid, uniform_rows_keys, uniform_rows_score_grad, chunk_owners, prefetched)()


def _call_setup(q: Tensor, k: Tensor, group_names, layout: str, mask: str, plan: str, doc_ids, key_valid,
                chunk_owners):
    """``(ring, mask spec, layout, mask data, backward plan)`` of a backward call (its prefetch's too)."""
    ring, spec = _ring_of(group_names), MaskSpec.decode(mask)
    layout = resolve_layout(layout, chunk_owners, q.shape[2] * ring.size)
    data = _mask_data(spec, doc_ids, key_valid, q.shape[0], q.shape[2] * ring.size, q.device)
    return ring, spec, layout, data, resolve_plan(plan, q, k, ring.size, layout, spec)


def _start_backward(grad_out, q, k, v, out, lse, grad_lse, group_names, layout, mask, scale, plan, doc_ids,
                    key_valid, uniform_rows_keys, uniform_rows_score_grad, chunk_owners, prefetched=None
                    ) -> Callable[[], tuple[Tensor, Tensor, Tensor]]:
    """The backward up to its last hop (posted, not waited for); the returned function finishes it."""
    ahead = None if prefetched is None else _redeem(
        _PENDING_PREFETCHES, prefetched, "was never posted or is already used (a prefetch feeds exactly one "
        "backward, after it)")
    ring, spec, layout, data, plan = _call_setup(q, k, group_names, layout, mask, plan, doc_ids, key_valid,
                                                 chunk_owners)
    finish_ring = start_ring_backward(plan, grad_out, q, k, v, out, lse, grad_lse, ring, layout, spec, scale, data,
                                      ahead)

    def finish() -> tuple[Tensor, Tensor, Tensor]:
        grads = finish_ring()
        rows = _uniform_rows(spec, data, uniform_rows_keys, layout, ring, q.shape[2], q.device)
        if rows is None:
            return grads
        shares = uniform_rows_grads(grad_out, q, k, v, rows, uniform_rows_keys, scale, ring,
                                    uniform_rows_score_grad, spec)
        return tuple(g if share is None else (g.to(ACC_DTYPE) + share).to(g.dtype) for g, share in zip(grads, shares))

    return finish


@_ring_attention_backward_op.register_fake
def _(grad_out, q, k, v, out, lse, grad_lse, group_names, layout, mask, scale, plan, doc_ids=None, key_valid=None,
      uniform_rows_keys=0, uniform_rows_score_grad=True, chunk_owners=None, prefetched=None):
    return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape)


# The backward's first transfer posted ahead of it (the ``prefetch_ring_backward`` pass,
# ``burstc/passes/prefetch_ring_backward.py``): what the first transfer carries that exists before the backward has
# its ``grad_out`` (K and V for ``kv_ring``, Q and the LSE for ``burst``; on the double ring the first lane's, over
# the inter-node link) goes out from a node of its own, ahead of the layer's other backward work; the backward
# posts the rest of that transfer when it starts.  Returns a token (a CPU int64 scalar) the backward's
# ``prefetched`` argument takes; the posted transfer waits in ``_PENDING_PREFETCHES`` under it.  Every rank runs
# the same graph, so every pair of ranks posts the same parts in the same order.
_PENDING_PREFETCHES: dict[int, object] = {}
_NEXT_TOKEN = [0]  # the last token issued (prefetches' and split backwards' alike)
_MISSING = object()


def _issue(pending: dict, value) -> Tensor:
    """A new token (a CPU int64 scalar: reading it never waits on a device) under which ``value`` waits."""
    _NEXT_TOKEN[0] += 1
    pending[_NEXT_TOKEN[0]] = value
    return torch.tensor(_NEXT_TOKEN[0], dtype=torch.int64)


def _redeem(pending: dict, token: Tensor, misuse: str):
    """What waits under ``token``, taken out (a token is used once); an error naming ``misuse`` otherwise."""
    value = pending.pop(int(token), _MISSING)
    if value is _MISSING:
        raise RuntimeError(f"burstc ring attention: token {int(token)} {misuse}")
    return value


@torch.library.custom_op("burstc::ring_attention_backward_prefetch", mutates_args=(), schema=_PREFETCH_SCHEMA)
@without_autocast
def _ring_attention_backward_prefetch_op(q: Tensor, k: Tensor, v: Tensor, lse: Tensor, group_names: list[str],
                                         layout: str, mask: str, scale: float, plan: str,
                                         doc_ids: Tensor | None = None, key_valid: Tensor | None = None,
                                         uniform_rows_keys: int = 0, uniform_rows_score_grad: bool = True,
                                         chunk_owners: Tensor | None = None) -> Tensor:
    ring, spec, layout, data, plan = _call_setup(q, k, group_names, layout, mask, plan, doc_ids, key_valid,
                                                 chunk_owners)
    # None on the hybrid ring (its exchanges are all-to-alls): the backward then posts everything itself
    return _issue(_PENDING_PREFETCHES, prefetch_backward(plan, q, k, v, lse, ring, layout, spec, data))


@_ring_attention_backward_prefetch_op.register_fake
def _(q, *args, **kwargs):
    return torch.empty((), dtype=torch.int64, device="cpu")


# The backward split in two (the ``overlap_ring_backward`` pass, ``burstc/passes/overlap_ring_backward.py``):
# ``..._start`` runs the backward up to its last hop (the last visitor's gradients going home), posts that hop
# and returns a token (a CPU int64 scalar: reading it never waits on a device); ``..._finish`` waits for the hop
# and returns ``(dq, dk, dv)`` (``q, k, v`` give only their shapes and dtypes).  What a graph runs between the two
# overlaps the hop.  The pending calls wait in ``_PENDING_BACKWARDS`` under their token; a token is finished
# exactly once, by the same rank, in the graph order every rank shares.
_PENDING_BACKWARDS: dict[int, Callable[[], tuple[Tensor, Tensor, Tensor]]] = {}
_START_SCHEMA = _BACKWARD_SCHEMA.replace("-> (Tensor, Tensor, Tensor)", "-> Tensor")


@torch.library.custom_op("burstc::ring_attention_backward_start", mutates_args=(), schema=_START_SCHEMA)
@without_autocast
def _ring_attention_backward_start_op(grad_out: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor,
                                      grad_lse: Tensor | None, group_names: list[str], layout: str, mask: str,
                                      scale: float, plan: str, doc_ids: Tensor | None = None,
                                      key_valid: Tensor | None = None, uniform_rows_keys: int = 0,
                                      uniform_rows_score_grad: bool = True, chunk_owners: Tensor | None = None,
                                      prefetched: Tensor | None = None) -> Tensor:
    finish = _start_backward(grad_out, q, k, v, out, lse, grad_lse, group_names, layout, mask, scale, plan, doc_ids,
                             key_valid, uniform_rows_keys, uniform_rows_score_grad, chunk_owners, prefetched)
    return _issue(_PENDING_BACKWARDS, finish)


@_ring_attention_backward_start_op.register_fake
def _(grad_out, q, *args, **kwargs):
    return torch.empty((), dtype=torch.int64, device="cpu")


@torch.library.custom_op("burstc::ring_attention_backward_finish", mutates_args=(),
                         schema="(Tensor token, Tensor q, Tensor k, Tensor v, Tensor[] after) -> "
                                "(Tensor, Tensor, Tensor)")
def _ring_attention_backward_finish_op(token: Tensor, q: Tensor, k: Tensor, v: Tensor, after: Sequence[Tensor]
                                       ) -> tuple[Tensor, Tensor, Tensor]:
    # ``after``: values the graph computes while the hop travels, read by nothing here: they order the finish after
    # that work for a compiler that reorders (Inductor)
    return _redeem(_PENDING_BACKWARDS, token, "was never started or is already finished (a split backward's "
                   "finish must run once, after its start)")()


@_ring_attention_backward_finish_op.register_fake
def _(token, q, k, v, after):
    return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape)


def _setup_context(ctx, inputs, output):
    q, k, v, *config, doc_ids, key_valid, uniform_rows_keys, uniform_rows_score_grad, chunk_owners, query_rows = inputs
    if 0 <= query_rows < q.shape[2]:
        raise NotImplementedError("ring_attention_forward with query_rows (a recompute of some rows) is not "
                                  "differentiable")
    out, lse = output
    ctx.save_for_backward(q, k, v, out, lse, doc_ids, key_valid, chunk_owners)
    ctx.config = tuple(config)  # (group_names, layout, mask, scale, plan)
    ctx.uniform_rows = (uniform_rows_keys, uniform_rows_score_grad)
    # an output nothing reads gets None, not zeros: the lse is rarely read, and the backward would otherwise have to
    # read a zero lse gradient on the host to know it is zero (a synchronization on a GPU, every call)
    ctx.set_materialize_grads(False)


def _backward(ctx, grad_out, grad_lse):
    q, k, v, out, lse, doc_ids, key_valid, chunk_owners = ctx.saved_tensors
    if grad_out is None:  # only the lse is read
        grad_out = torch.zeros_like(out)
    dq, dk, dv = torch.ops.burstc.ring_attention_backward(grad_out, q, k, v, out, lse, grad_lse, *ctx.config,
                                                          doc_ids, key_valid, *ctx.uniform_rows, chunk_owners)
    return dq, dk, dv, None, None, None, None, None, None, None, None, None, None, None


_ring_attention_forward_op.register_autograd(_backward, setup_context=_setup_context)
# autocast runs SDPA in lower precision: so does the ring that replaces it (q, k, v cast alike)
register_lower_precision(_ring_attention_forward_op, (0, 1, 2))


# ---------------------------------------------------------------------------------------------
# Public API


RING_KINDS = ("auto", "flat", "double", "ulysses")
# what a query row that sees no key gets: SDPA's 0, or eager's uniform average over every key, its scores added to
# (an additive finfo.min mask: the scores keep their gradient) or replaced (masked_fill: no gradient to q and k)
HIDDEN_ROWS = ("zero", "uniform", "uniform_replaced")


def resolve_ring_groups(group_or_mesh=None, ring: str = "auto") -> tuple[list[str], int]:
    """A ProcessGroup, a DeviceMesh, or None (the default group) -> ``(the op's group names, world size)``: one
    group (a flat ring), ``[inter, intra]`` (a double ring over a 2-D mesh whose first dim spans nodes and second
    the ranks of a node) or ``["ulysses", intra, inter]`` (the hybrid, :mod:`burstc.ops.ulysses`).  ``ring``:
    ``"flat"``, ``"double"``, ``"ulysses"`` or ``"auto"`` (double on a 2-D mesh of at least 2 x 2, else flat; a
    flat ring over a 2-D mesh runs over its flattened, node-major order)."""
    if ring not in RING_KINDS:
        raise ValueError(f"ring must be one of {RING_KINDS}, got {ring!r}")
    if not (dist.is_available() and dist.is_initialized()):
        raise RuntimeError(
            "ring_attention needs an initialized torch.distributed process group: call "
            "dist.init_process_group(...) first (world size 1 is fine for single-process use)")
    from torch.distributed.device_mesh import DeviceMesh

    if isinstance(group_or_mesh, DeviceMesh) and group_or_mesh.ndim == 2:
        nodes, per_node = group_or_mesh.shape
        inter, intra = group_or_mesh.get_group(0).group_name, group_or_mesh.get_group(1).group_name
        if ring in ("double", "ulysses") and (nodes < 2 or per_node < 2):
            raise ValueError(f"a {ring} ring needs a mesh of at least 2 x 2, got {nodes} x {per_node}")
        if ring == "ulysses":
            return [UlyssesRing.ULYSSES, intra, inter], nodes * per_node
        if ring == "double" or (ring == "auto" and nodes >= 2 and per_node >= 2):
            return [inter, intra], nodes * per_node
        return [group_or_mesh._flatten().get_group().group_name], nodes * per_node
    if ring in ("double", "ulysses"):
        raise ValueError(f"a {ring} ring needs a 2-D DeviceMesh (nodes x ranks per node), got {group_or_mesh!r}")
    if group_or_mesh is None:
        group = dist.group.WORLD
    elif isinstance(group_or_mesh, DeviceMesh):
        if group_or_mesh.ndim != 1:
            raise ValueError(f"ring_attention needs a 1-D or 2-D DeviceMesh, got {group_or_mesh.ndim}-D {group_or_mesh}")
        group = group_or_mesh.get_group()
    elif isinstance(group_or_mesh, dist.ProcessGroup):
        group = group_or_mesh
    else:
        raise TypeError(f"group_or_mesh must be a ProcessGroup, a DeviceMesh or None, got {type(group_or_mesh)}")
    return [group.group_name], dist.get_world_size(group)


def _resolve_mask(causal: bool | None, mask: MaskSpec | None) -> MaskSpec:
    """``mask=`` if given (then ``causal=`` must be left out), else causal (the default) or full."""
    if mask is None:
        return MaskSpec.full() if causal is False else MaskSpec.causal()
    if causal is not None:
        raise ValueError("pass either causal= or mask=, not both")
    if not isinstance(mask, MaskSpec):
        raise TypeError(f"mask must be a burstc.attention_ir.MaskSpec, got {type(mask)}")
    return check_executable(mask)


def _check_inputs(q: Tensor, k: Tensor, v: Tensor, layout: str, plan: str) -> None:
    check_layout(layout)
    if plan not in PLAN_CHOICES:
        raise ValueError(f"plan must be one of {PLAN_CHOICES}, got {plan!r}")
    if q.dim() != 4 or k.dim() != 4 or v.dim() != 4:
        raise ValueError(f"q, k, v must be [B, H, S_local, D]; got shapes {tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}")
    if k.shape != v.shape:
        raise ValueError(f"k and v must have the same shape, got {tuple(k.shape)} and {tuple(v.shape)}")
    (batch, heads_q, local_len, head_dim), (batch_kv, heads_kv, local_len_kv, head_dim_kv) = q.shape, k.shape
    if (batch, local_len, head_dim) != (batch_kv, local_len_kv, head_dim_kv):
        raise ValueError(f"q {tuple(q.shape)} and k/v {tuple(k.shape)} must agree in B, S_local and D")
    if heads_q % heads_kv:
        raise ValueError(f"the number of query heads ({heads_q}) must be a multiple of the number of kv heads ({heads_kv})")
    if local_len < 1:
        raise ValueError("S_local must be at least 1")
    if layout == "zigzag" and local_len % 2:
        raise ValueError(f"layout 'zigzag' holds two equal chunks per rank, so S_local must be even, got {local_len}")
    if layout == DOCUMENTS:
        raise ValueError(f"layout {DOCUMENTS!r} is one call's chunk assignment: pass a burstc.layout.ChunkLayout "
                         "(e.g. from burstc.balance_documents.chunk_owners)")
    if not (q.dtype == k.dtype == v.dtype) or q.dtype not in SUPPORTED_DTYPES:
        raise TypeError(f"q, k, v must share one dtype among {SUPPORTED_DTYPES}, got {q.dtype}, {k.dtype}, {v.dtype}")
    if not (q.device == k.device == v.device):
        raise ValueError(f"q, k, v must be on one device, got {q.device}, {k.device}, {v.device}")


def ring_attention_with_lse(q: Tensor, k: Tensor, v: Tensor, *, group_or_mesh=None, causal: bool | None = None,
                            mask: MaskSpec | None = None, layout: str | ChunkLayout = "zigzag",
                            plan: str = "auto", scale: float | None = None, doc_ids: Tensor | None = None,
                            key_valid: Tensor | None = None, ring: str = "auto",
                            hidden_rows: str = "zero") -> tuple[Tensor, Tensor]:
    """Ring attention over ``group_or_mesh``; returns ``(out [B, Hq, S_local, D] in q.dtype,
    lse [B, Hq, S_local] fp32)`` (natural log of the scaled scores).  Both are differentiable.

    q ``[B, Hq, S_local, D]``, k/v ``[B, Hkv, S_local, D]`` with ``Hq % Hkv == 0``, tokens in
    ``layout`` order (:func:`burstc.layout.local_positions`; a :class:`burstc.layout.ChunkLayout` is one call's
    documents layout).  The mask: ``causal=`` (default True)
    or a :class:`burstc.attention_ir.MaskSpec` (``mask=``; every static spec runs, and
    ``Documents`` / ``KeyPadding`` with their data: ``doc_ids`` integer and ``key_valid`` bool, both
    ``[B, S_global]`` over the whole sequence in global order, given exactly when the spec has the
    term).  ``plan`` picks the backward (``"kv_ring"``, ``"burst"`` or ``"auto"``: the planner's
    cheaper one).  A query row that sees nothing gets out 0, lse -inf, zero gradients (as SDPA;
    ``hidden_rows="zero"``), or with ``hidden_rows="uniform"`` (only with a ``KeyPadding`` term) the mean of V
    over every key, with the gradients of a uniform softmax: what a model that fills hidden scores with
    ``finfo.min`` computes (HF eager attention; :mod:`burstc.ops.hidden_rows`), its lse staying -inf;
    ``"uniform_replaced"``: the same output for a model that replaces the hidden scores (``masked_fill``), whose
    q and k then get no gradient through them.
    ``group_or_mesh`` may be a 2-D mesh (nodes x ranks per node; tokens in its node-major order): ``ring``
    picks a ``"double"`` ring (the default there, :mod:`burstc.ops.double_ring`), a ``"flat"`` one, or
    ``"ulysses"`` (all-to-all inside a node, a ring across nodes: :mod:`burstc.ops.ulysses`).
    """
    mask = _resolve_mask(causal, mask)
    _check_data_present(mask, doc_ids, key_valid)
    if hidden_rows not in HIDDEN_ROWS:
        raise ValueError(f"hidden_rows must be one of {HIDDEN_ROWS}, got {hidden_rows!r}")
    if hidden_rows != "zero" and mask.term(KeyPadding) is None:
        raise ValueError(f"hidden_rows={hidden_rows!r} needs a KeyPadding term: no other term hides a whole row")
    q, k, v = cast_like_lower_precision((q, k, v), q.device.type)  # as SDPA under torch.autocast
    _check_inputs(q, k, v, layout, plan)
    group_names, world_size = resolve_ring_groups(group_or_mesh, ring)
    _mask_data(mask, doc_ids, key_valid, q.shape[0], q.shape[2] * world_size, q.device)
    chunk_owners = None
    if isinstance(layout, ChunkLayout):
        if (layout.seq_len, layout.world_size) != (q.shape[2] * world_size, world_size):
            raise ValueError(f"the chunk layout covers {layout.seq_len} tokens on {layout.world_size} ranks, the call "
                             f"{q.shape[2] * world_size} on {world_size}")
        layout, chunk_owners = DOCUMENTS, host_reads.to_device(torch.tensor(layout.owners, dtype=torch.int64),
                                                               q.device)
    scale = q.shape[-1] ** -0.5 if scale is None else float(scale)
    if ring == "ulysses":
        from burstc.ops.ulysses import hybrid_applies

        problem = hybrid_applies(layout, q.shape[1], k.shape[1], world_size // dist.get_world_size(
            resolve_group(group_names[2])))
        if problem:
            raise ValueError(f"ring='ulysses': {problem}")
    uniform_rows_keys = q.shape[2] * world_size if hidden_rows != "zero" else 0
    return torch.ops.burstc.ring_attention_forward(q, k, v, group_names, layout, mask.encode(), scale, plan,
                                                   doc_ids, key_valid, uniform_rows_keys, hidden_rows == "uniform",
                                                   chunk_owners)


def ring_attention(q: Tensor, k: Tensor, v: Tensor, *, group_or_mesh=None, causal: bool | None = None,
                   mask: MaskSpec | None = None, layout: str | ChunkLayout = "zigzag", plan: str = "auto",
                   scale: float | None = None, doc_ids: Tensor | None = None,
                   key_valid: Tensor | None = None, ring: str = "auto", hidden_rows: str = "zero") -> Tensor:
    """Like :func:`ring_attention_with_lse`, returning only the output."""
    out, _ = ring_attention_with_lse(q, k, v, group_or_mesh=group_or_mesh, causal=causal, mask=mask, layout=layout,
                                     plan=plan, scale=scale, doc_ids=doc_ids, key_valid=key_valid, ring=ring,
                                     hidden_rows=hidden_rows)
    return out
