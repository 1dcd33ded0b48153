"""Masked ring attention measured on P gloo ranks (issue 16, part 6b): dense causal vs a sliding window vs packed
documents, forward + backward, side by side in one run.

    python benchmarks/document_ring.py                        # P = 4, S = 32K, 4 heads x 64, fp32
    python benchmarks/document_ring.py --P 2 --S 4096 --iters 1   # a smoke run

Rows (the same q, k, v, dO on every row; the document rows share one sampled long-tail mix,
:func:`burstc.testing.balance.sample_document_lengths`, each document at most S/4):

* ``causal``: dense causal, zigzag (its balanced layout).
* ``window S/16``: causal with a window of S/16 keys, contiguous (the layout ``layout="auto"`` picks for it).
* ``documents, zigzag, untrimmed``: causal & documents with the ids relabelled out of order (the same documents),
  so the ring evaluates whole static blocks and masks them element-wise: what the ring did before documents
  trimmed its blocks.
* ``documents, zigzag``: sorted ids, the blocks trimmed to the documents.
* ``documents, balanced chunks``: the documents layout (``layout="documents"``, what ``"auto"`` picks for packed
  documents): each call's chunks assigned by :func:`burstc.balance_documents.chunk_owners`.
* ``documents, cost model's choice``: what ``layout="auto"`` runs for packed documents: the owners op with the cost
  model's prices (``--compute-gflops``, ``--inter-mbps``; defaults: the CPU calibration of the emulated H100 cluster,
  45 GFLOP/s and 11.3 MB/s), which gives the balanced chunks or zigzag's per call, whichever it predicts faster.
* ``torch FlexAttention CP``: torch 2.13's context parallelism for FlexAttention, wired as its ``_ContextParallel``
  FLEX style does: the default head-tail load balancer (its per-document one needs every length a multiple of 2P),
  ``_create_cp_block_mask`` with the document-causal ``mask_mod``, K/V all-gathered (``flex_cp_allgather``) and
  ``torch.compile(flex_attention)`` on the local queries.  Forward only: torch has no FlexAttention backward on CPU.
  Its compile happens in the warm-up round.

Columns: step seconds (fwd + bwd, slowest rank, best and median of the rounds), the assignment's own seconds
(documents layout), MiB sent per rank (fwd + bwd, burstc's byte counter, busiest rank), the forward's K/V rows
received by the busiest receiver against its zero-redundancy bound (the rows some query of the rank sees, counted
densely from the data) and the largest ratio over ranks, visible work max/mean
over ranks, evaluated entries (kernel rectangles) max/mean and the busiest rank's evaluated entries over the dense
causal row's.  Errors against single-device SDPA with the dense mask on the first step (``--no-reference`` skips).
Under the emulated network (``../shared/tools/emulated-cluster``) the same command measures the transfers too.
"""
from __future__ import annotations

import argparse
import os
import time

import torch
import torch.nn.functional as F

from burstc import layout as layouts
from burstc.attention_ir import Documents, MaskSpec, SlidingWindow
from burstc.balance_documents import document_ids_of_lengths, finest_chunks_per_rank, zigzag_owners
from burstc.layout import ChunkLayout
from burstc.ops import ring_attention as ra
from burstc.testing.balance import sample_document_lengths
from burstc.testing.workers import WorkerGroup

CAUSAL = MaskSpec.causal()
DOCS = Documents("doc_ids")
FLEX_ROW = "torch FlexAttention CP (documents, forward only)"
CHOICE_ROW = "documents, cost model's choice"
ROWS = ("causal", "window S/16", "documents, zigzag, untrimmed", "documents, zigzag", "documents, balanced chunks",
        CHOICE_ROW, FLEX_ROW)


def _inputs(args):
    generator = torch.Generator().manual_seed(args.seed)
    q, grad_out = (torch.randn(1, args.heads, args.S, args.head_dim, generator=generator) for _ in range(2))
    k, v = (torch.randn(1, args.heads, args.S, args.head_dim, generator=generator) for _ in range(2))
    lengths = sample_document_lengths(args.S, torch.Generator().manual_seed(args.seed))
    doc_ids = document_ids_of_lengths(lengths)[None]
    return (q, k, v, grad_out), doc_ids, lengths


def _row_setup(row: str, args, doc_ids, world_size: int):
    """``(mask, layout, doc ids or None, seconds to compute the layout)`` of a row."""
    if row == "causal":
        return CAUSAL, "zigzag", None, 0.0
    if row == "window S/16":
        return CAUSAL & SlidingWindow(args.S // 16 - 1), "contiguous", None, 0.0
    if row == "documents, zigzag, untrimmed":
        relabelled = doc_ids.max() - doc_ids  # the same documents, ids decreasing: no trimming
        return CAUSAL & DOCS, "zigzag", relabelled, 0.0
    if row == "documents, zigzag":
        return CAUSAL & DOCS, "zigzag", doc_ids, 0.0
    prices = ()
    if row == CHOICE_ROW:  # the shard pass's prices for this one attention layer (passes/shard.py)
        flops_per_entry = 14 * args.heads * args.head_dim  # fwd 4D + bwd 10D per head
        row_bytes = 3 * 2 * args.heads * args.head_dim * 4  # K and V rows, fp32, B = 1: forward, K/V and dK/dV back
        prices = (flops_per_entry / (args.compute_gflops * 1e9), row_bytes / (args.inter_mbps * 1e6))
    started = time.perf_counter()
    owners = torch.ops.burstc.document_chunks(doc_ids, world_size, finest_chunks_per_rank(args.S, world_size),
                                              *prices)
    seconds = time.perf_counter() - started
    if row == CHOICE_ROW:
        picked = "zigzag" if torch.equal(owners, zigzag_owners(world_size, finest_chunks_per_rank(args.S, world_size))) \
            else "balanced"
        print(f"rank {torch.distributed.get_rank()}: the cost model picked the {picked} chunks", flush=True)
    return CAUSAL & DOCS, ChunkLayout.from_owners(owners, args.S), doc_ids, seconds


def _task(rank: int, world_size: int, args) -> dict:
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // world_size))
    (q, k, v, grad_out), doc_ids, _ = _inputs(args)
    results = {}
    for round_index in range(args.iters + 1):  # round 0 warms up (and checks the errors)
        for row in args.rows:
            if row == FLEX_ROW:
                seconds = _flex_cp_forward(rank, world_size, (q, k, v), doc_ids)
                entry = results.setdefault(row, {"step_s": [], "forward_s": [], "layout_s": 0.0})
                if round_index:
                    entry["forward_s"].append(seconds)
                    entry["step_s"].append(float("nan"))
                continue
            mask, layout, ids, layout_s = _row_setup(row, args, doc_ids, world_size)
            mine = layouts.local_positions(args.S, world_size, rank, layout)
            local = [t.index_select(2, mine) for t in (q, k, v)]
            leaves = [t.clone().requires_grad_() for t in local]
            torch.distributed.barrier()
            started = time.perf_counter()
            with ra.record_stats() as stats:
                out = ra.ring_attention(*leaves, mask=mask, layout=layout, doc_ids=ids)
                forward_s = time.perf_counter() - started
                out.backward(grad_out.index_select(2, mine))
            seconds = time.perf_counter() - started
            entry = results.setdefault(row, {"step_s": [], "forward_s": [], "layout_s": layout_s})
            if round_index == 0:
                forward, backward = stats.of("forward")[0], stats.of("backward")[0]
                kv_row_bytes = 2 * k.shape[1] * k.shape[3] * k.element_size()  # a K row and a V row, B = 1
                entry.update(
                    bytes=forward.total_bytes_sent + backward.total_bytes_sent,
                    forward_rows=sum(forward.bytes_received_per_step) // kv_row_bytes,
                    forward_bound_rows=_bound_rows(mask, layout, ids, args.S, world_size, rank),
                    work=forward.total_work, entries=sum(forward.kernel_entries_per_step),
                    plan=backward.plan)
                if not args.no_reference:
                    entry["error"] = _error(row, mask, ids, (q, k, v, grad_out), out, leaves, mine)
            else:
                entry["step_s"].append(seconds)
                entry["forward_s"].append(forward_s)
    return results


_FLEX = {}


def _flex_cp_forward(rank: int, world_size: int, full, doc_ids) -> float:
    """torch's FlexAttention context parallelism, forward: seconds of this rank's call (all-gather + attention)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.experimental._context_parallel._attention import _create_cp_block_mask
    from torch.distributed.tensor.experimental._context_parallel._cp_custom_ops import flex_cp_allgather
    from torch.distributed.tensor.experimental._context_parallel._load_balancer import _HeadTailLoadBalancer
    from torch.nn.attention.flex_attention import flex_attention

    q, k, v = full
    seq_len = q.shape[2]
    if not _FLEX:
        mesh = init_device_mesh("cpu", (world_size,))
        balancer = _HeadTailLoadBalancer(seq_len, world_size, "cpu")
        ids_S = doc_ids[0]

        def document_causal(b, h, q_idx, kv_idx):
            return (ids_S[q_idx] == ids_S[kv_idx]) & (q_idx >= kv_idx)

        order = balancer._generate_indices(restore=False)[0]
        _FLEX.update(mesh=mesh, order=order, attention=torch.compile(flex_attention),
                     block_mask=_create_cp_block_mask(document_causal, 1, 1, seq_len, seq_len, mesh, balancer))
    mine = _FLEX["order"].view(world_size, -1)[rank]
    q_l, k_l, v_l = (t.index_select(2, mine).contiguous() for t in (q, k, v))
    group_name = _FLEX["mesh"].get_group().group_name
    torch.distributed.barrier()
    started = time.perf_counter()
    k_all, v_all = flex_cp_allgather(k_l, v_l, 2, group_name)
    _FLEX["attention"](q_l, k_all, v_all, block_mask=_FLEX["block_mask"])
    return time.perf_counter() - started


def _bound_rows(mask, layout, ids, seq_len: int, world_size: int, rank: int) -> int:
    """The zero-redundancy bound of this rank's forward: the K/V rows of other ranks that some query of this rank
    sees (each such row must arrive once; dense per pair, exact for any data)."""
    mine = layouts.local_positions(seq_len, world_size, rank, layout)
    needed = 0
    for other in range(world_size):
        if other == rank:
            continue
        theirs = layouts.local_positions(seq_len, world_size, other, layout)
        docs = {} if ids is None else {"q_docs": ids[:, mine], "kv_docs": ids[:, theirs]}
        needed += int(mask.visible(mine, theirs, **docs).reshape(-1, len(mine), len(theirs)).any(0).any(0).sum())
    return needed


def _kv_bytes(args) -> int:
    """One rank's K and V shard (fp32, B = 1): what an all-gather sends to each other rank."""
    return 2 * args.heads * (args.S // args.P) * args.head_dim * 4


def _error(row, mask, ids, full, out, leaves, mine) -> float:
    q, k, v, grad_out = full
    pos = torch.arange(q.shape[2])
    visible = mask.visible(pos, pos, q_docs=None if ids is None else ids[:, pos],
                           kv_docs=None if ids is None else ids[:, pos]).expand(1, len(pos), len(pos)).unsqueeze(1)
    ref = [t.clone().requires_grad_() for t in (q, k, v)]
    ref_out = F.scaled_dot_product_attention(*ref, attn_mask=visible)
    ref_out.backward(grad_out)
    errors = [(out - ref_out.detach()[:, :, mine]).abs().max()]
    errors += [(leaf.grad - r.grad[:, :, mine]).abs().max() for leaf, r in zip(leaves, ref)]
    return float(torch.stack(errors).max().detach())


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--P", type=int, default=4)
    parser.add_argument("--S", type=int, default=32768)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--iters", type=int, default=2, help="timed rounds after the warm-up round")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--rows", nargs="+", choices=ROWS, default=list(ROWS))
    parser.add_argument("--no-reference", action="store_true", help="skip the single-device error check")
    parser.add_argument("--compute-gflops", type=float, default=45.0, help="the cost model's attention GFLOP/s")
    parser.add_argument("--inter-mbps", type=float, default=11.3, help="the cost model's ring link, MB/s")
    args = parser.parse_args(argv)
    _, _, lengths = _inputs(args)
    print(f"P={args.P} S={args.S} B=1 H={args.heads} D={args.head_dim} fp32; {len(lengths)} documents "
          f"(longest {max(lengths)}, median {sorted(lengths)[len(lengths) // 2]}); load average "
          f"{os.getloadavg()[0]:.1f} on {os.cpu_count()} cores", flush=True)
    with WorkerGroup(args.P, run_timeout_s=6 * 3600) as workers:
        per_rank = workers.run(_task, args)
    dense_entries = max(r["causal"]["entries"] for r in per_rank) if "causal" in args.rows else None
    if "documents, balanced chunks" in args.rows and FLEX_ROW in args.rows:
        ours, flex = (min(max(r[row]["forward_s"][i] for r in per_rank) for i in range(args.iters))
                      for row in ("documents, balanced chunks", FLEX_ROW))
        print(f"documents forward: burstc (balanced chunks) {ours:.2f} s vs torch FlexAttention CP {flex:.2f} s: "
              f"{ours / flex:.2f}x its time")
    print("| row | step s (best) | step s (median) | fwd s (best) | layout s | MiB sent/rank "
          "| fwd rows received / bound | work max/mean | evaluated max/mean | evaluated vs causal | bwd plan "
          "| max error |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    for row in args.rows:
        ranks = [r[row] for r in per_rank]
        slowest = lambda key: [max(r[key][i] for r in ranks) for i in range(len(ranks[0][key]))]  # noqa: E731
        steps, forwards = slowest("step_s"), slowest("forward_s")
        if row == FLEX_ROW:
            print(f"| {row} | - | - | {min(forwards):.2f} | - | {(args.P - 1) * _kv_bytes(args) / 2**20:.1f} (fwd) "
                  "| all K/V | - | - | - | - | - |", flush=True)
            continue
        works, entries = [r["work"] for r in ranks], [r["entries"] for r in ranks]
        versus = f"{max(entries) / dense_entries:.3f}" if dense_entries else "-"
        error = f"{max(r['error'] for r in ranks):.1e}" if "error" in ranks[0] else "-"
        busiest = max(ranks, key=lambda r: r["forward_rows"])
        over_bound = max(r["forward_rows"] / max(r["forward_bound_rows"], 1) for r in ranks)
        print(f"| {row} | {min(steps):.2f} | {sorted(steps)[len(steps) // 2]:.2f} | {min(forwards):.2f} "
              f"| {ranks[0]['layout_s']:.3f} | {max(r['bytes'] for r in ranks) / 2**20:.1f} "
              f"| {busiest['forward_rows']} / {busiest['forward_bound_rows']} (max ratio {over_bound:.3f}) "
              f"| {max(works) / (sum(works) / len(works)):.3f} "
              f"| {max(entries) / (sum(entries) / len(entries)):.3f} | {versus} | {ranks[0]['plan']} | {error} |",
              flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
