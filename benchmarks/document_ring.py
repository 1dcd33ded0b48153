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

Columns: step seconds (fwd + bwd, slowest rank, best and median of the rounds), the assignment's own seconds
(documents layout), MiB sent per rank (fwd + bwd, burstc's byte counter, busiest rank), visible work max/mean
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
from burstc.balance_documents import chunk_owners, document_ids_of_lengths, finest_chunks_per_rank
from burstc.layout import ChunkLayout
from burstc.ops import ring_attention as ra
from burstc.testing.balance import sample_document_lengths
from burstc.testing.workers import WorkerGroup

CAUSAL = MaskSpec.causal()
DOCS = Documents("doc_ids")
ROWS = ("causal", "window S/16", "documents, zigzag, untrimmed", "documents, zigzag", "documents, balanced chunks")


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
    started = time.perf_counter()
    owners = torch.ops.burstc.document_chunks(doc_ids, world_size, finest_chunks_per_rank(args.S, world_size))
    seconds = time.perf_counter() - started
    return CAUSAL & DOCS, ChunkLayout.from_owners(owners, args.S), doc_ids, seconds


def _task(rank: int, world_size: int, args) -> dict:
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // world_size))
    (q, k, v, grad_out), doc_ids, _ = _inputs(args)
    results = {}
    for round_index in range(args.iters + 1):  # round 0 warms up (and checks the errors)
        for row in args.rows:
            mask, layout, ids, layout_s = _row_setup(row, args, doc_ids, world_size)
            mine = layouts.local_positions(args.S, world_size, rank, layout)
            local = [t.index_select(2, mine) for t in (q, k, v)]
            leaves = [t.clone().requires_grad_() for t in local]
            torch.distributed.barrier()
            started = time.perf_counter()
            with ra.record_stats() as stats:
                out = ra.ring_attention(*leaves, mask=mask, layout=layout, doc_ids=ids)
                out.backward(grad_out.index_select(2, mine))
            seconds = time.perf_counter() - started
            entry = results.setdefault(row, {"step_s": [], "layout_s": layout_s})
            if round_index == 0:
                forward, backward = stats.of("forward")[0], stats.of("backward")[0]
                entry.update(
                    bytes=forward.total_bytes_sent + backward.total_bytes_sent,
                    work=forward.total_work, entries=sum(forward.kernel_entries_per_step),
                    plan=backward.plan)
                if not args.no_reference:
                    entry["error"] = _error(row, mask, ids, (q, k, v, grad_out), out, leaves, mine)
            else:
                entry["step_s"].append(seconds)
    return results


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
    args = parser.parse_args(argv)
    _, _, lengths = _inputs(args)
    print(f"P={args.P} S={args.S} B=1 H={args.heads} D={args.head_dim} fp32; {len(lengths)} documents "
          f"(longest {max(lengths)}, median {sorted(lengths)[len(lengths) // 2]}); load average "
          f"{os.getloadavg()[0]:.1f} on {os.cpu_count()} cores", flush=True)
    with WorkerGroup(args.P, run_timeout_s=6 * 3600) as workers:
        per_rank = workers.run(_task, args)
    dense_entries = max(r["causal"]["entries"] for r in per_rank) if "causal" in args.rows else None
    print("| row | step s (best) | step s (median) | layout s | MiB sent/rank | work max/mean | evaluated max/mean "
          "| evaluated vs causal | bwd plan | max error |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for row in args.rows:
        ranks = [r[row] for r in per_rank]
        steps = [max(r["step_s"][i] for r in ranks) for i in range(len(ranks[0]["step_s"]))]
        works, entries = [r["work"] for r in ranks], [r["entries"] for r in ranks]
        versus = f"{max(entries) / dense_entries:.3f}" if dense_entries else "-"
        error = f"{max(r['error'] for r in ranks):.1e}" if "error" in ranks[0] else "-"
        print(f"| {row} | {min(steps):.2f} | {sorted(steps)[len(steps) // 2]:.2f} | {ranks[0]['layout_s']:.3f} "
              f"| {max(r['bytes'] for r in ranks) / 2**20:.1f} | {max(works) / (sum(works) / len(works)):.3f} "
              f"| {max(entries) / (sum(entries) / len(entries)):.3f} | {versus} | {ranks[0]['plan']} | {error} |",
              flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
