"""Mask-aware ring attention at scale, simulated: bytes per rank, the zero-redundancy bound, work balance.

No ranks needed: :mod:`burstc.testing.balance` counts what the op computes and sends with the functions the
op itself calls (tested against the counters of real 2- and 4-rank runs).  For P in {2, 4, 8, 16, 64} and the
masks causal, sliding window S/16 and sliding window S/(2P) (HF ``sliding_window``: causal, W keys), every
layout: the busiest rank's bytes per call (forward; the backward plan the planner picks), the largest per-rank
zero-redundancy bound, max over ranks of received / bound, the forward's bytes against the mask-blind ring's
(busiest rank, and all ranks together), and work max/mean.  A Llama-3-8B-like layer by default: B=1, 32 query / 8 kv heads, D=128, bf16.

    python benchmarks/masks.py                       # S = 64K, the README table
    python benchmarks/masks.py --S 16384 --P 2 4 8

``--documents N`` (issue 16, part 6a): N sampled long-tail document-length mixes packed into S tokens (each
document at most S/4; :func:`burstc.testing.balance.sample_document_lengths`, seed 0), and for each P the work
max/mean (causal & documents score entries of the busiest rank over the mean) at the 50th and 99th percentile and
the worst, of every scheme of :data:`burstc.testing.balance.DOCUMENT_SCHEMES` on the same mixes; beside it the
pieces a rank holds (runs of consecutive positions, median over mixes) and TE's pad tokens (99th percentile, % of S):

    python benchmarks/masks.py --documents 1000 --P 2 4 8 16     # S = 64K, the README table
"""
from __future__ import annotations

import argparse

import torch

from burstc.layout import LAYOUTS, required_multiple
from burstc.testing.balance import DOCUMENT_SCHEMES, HEADER, sample_document_lengths, simulate, simulate_documents, \
    table_row


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--S", type=int, default=65536)
    parser.add_argument("--P", nargs="+", type=int, default=[2, 4, 8, 16, 64])
    parser.add_argument("--documents", type=int, default=0, help="part 6a: this many document mixes instead")
    parser.add_argument("--chunks-per-rank", type=int, default=None, help="the burstc balancer's k (default: adaptive)")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)  # many tiny tensor ops: threads only contend
    if args.documents:
        documents_table(args.S, args.P, args.documents, args.chunks_per_rank)
        return
    print(HEADER)
    for world_size in args.P:
        for mask in dict.fromkeys(("causal", f"window:{args.S // 16}", f"window:{args.S // (2 * world_size)}")):
            for layout in LAYOUTS:
                if args.S % required_multiple(world_size, layout) == 0:
                    print(table_row(simulate(mask, layout, world_size, args.S)), flush=True)


def _percentile(values, q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


def documents_table(seq_len: int, world_sizes, samples: int, chunks_per_rank: int | None) -> None:
    generator = torch.Generator().manual_seed(0)
    mixes = [sample_document_lengths(seq_len, generator) for _ in range(samples)]
    documents = sorted(len(mix) for mix in mixes)
    print(f"{samples} mixes of S = {seq_len}: {documents[0]}..{documents[-1]} documents "
          f"(median {documents[len(documents) // 2]})\n")
    print("| P | scheme | work max/mean p50 | p99 | worst | pieces per rank (p50) | pad tokens p99 |")
    print("|---|---|---|---|---|---|---|")
    for world_size in world_sizes:
        for scheme in DOCUMENT_SCHEMES:
            found = [simulate_documents(mix, world_size, scheme, chunks_per_rank) for mix in mixes]
            ratios = [f.work_max_over_mean for f in found]
            print(f"| {world_size} | {scheme} | {_percentile(ratios, 0.5):.4f} | {_percentile(ratios, 0.99):.4f} "
                  f"| {max(ratios):.4f} | {_percentile([f.pieces for f in found], 0.5)} "
                  f"| {100 * _percentile([f.padding for f in found], 0.99) / seq_len:.2f}% |", flush=True)


if __name__ == "__main__":
    main()
