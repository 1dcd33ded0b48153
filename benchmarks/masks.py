"""Mask-aware ring attention at scale, simulated: bytes per rank, the zero-redundancy bound, work balance.

No ranks needed: :mod:`burstc.testing.balance` counts what the op computes and sends with the functions the
op itself calls (tested against the counters of real 2- and 4-rank runs).  For P in {2, 4, 8, 16, 64} and the
masks causal, sliding window S/16 and sliding window S/(2P) (HF ``sliding_window``: causal, W keys), every
layout: the busiest rank's bytes per call (forward; the backward plan the planner picks), the largest per-rank
zero-redundancy bound, max over ranks of received / bound, the forward's bytes against the mask-blind ring's
(busiest rank, and all ranks together), and work max/mean.  A Llama-3-8B-like layer by default: B=1, 32 query / 8 kv heads, D=128, bf16.

    python benchmarks/masks.py                       # S = 64K, the README table
    python benchmarks/masks.py --S 16384 --P 2 4 8
"""
from __future__ import annotations

import argparse

import torch

from burstc.layout import LAYOUTS, required_multiple
from burstc.testing.balance import HEADER, simulate, table_row


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--S", type=int, default=65536)
    parser.add_argument("--P", nargs="+", type=int, default=[2, 4, 8, 16, 64])
    args = parser.parse_args(argv)
    torch.set_num_threads(1)  # many tiny tensor ops: threads only contend
    print(HEADER)
    for world_size in args.P:
        for mask in dict.fromkeys(("causal", f"window:{args.S // 16}", f"window:{args.S // (2 * world_size)}")):
            for layout in LAYOUTS:
                if args.S % required_multiple(world_size, layout) == 0:
                    print(table_row(simulate(mask, layout, world_size, args.S)), flush=True)


if __name__ == "__main__":
    main()
