"""The masked block kernels' score-chunk budget: time and peak memory of one element-wise masked block (forward and
backward) at several budgets, one process, one thread.

    python benchmarks/masked_chunk_budget.py [--batch 4 --heads 4 --head-dim 64 --rows 2048 --budgets 256 64 32 16]

The block: causal & key padding over ``rows`` x ``rows`` (two batch rows padded), fp32, the kind a padded or
packed batch runs on the masked kernel (:mod:`burstc.kernels.masked_attention_blocks`).  Peaks above what was
resident (``burstc.memory.measure_peak``, glibc's mmap threshold lowered so that freed chunks leave the RSS).
"""
from __future__ import annotations

import argparse
import time

import torch

import burstc.kernels.masked_attention_blocks as masked
from burstc.attention_ir import KeyPadding, MaskSpec
from burstc.memory import exact_cpu_peaks, masked_kernel_bytes, measure_peak


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--rows", type=int, default=2048)
    parser.add_argument("--budgets", type=int, nargs="+", default=[256, 64, 32, 16], help="MiB")
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    torch.set_num_threads(1)
    exact_cpu_peaks()
    B, H, D, S = args.batch, args.heads, args.head_dim, args.rows
    spec = MaskSpec.causal() & KeyPadding("attention_mask")
    valid = torch.ones(B, S, dtype=torch.bool)
    valid[1 % B, S // 3:] = False
    valid[(B - 1), S // 2:] = False
    generator = torch.Generator().manual_seed(0)
    q, k, v, grad_out = (torch.randn(B, H, S, D, generator=generator) for _ in range(4))
    positions = torch.arange(S)
    default = masked.MASKED_SCORE_BUDGET_BYTES
    print("| budget MiB | fwd s (best) | fwd peak MiB | predicted | bwd s (best) | bwd peak MiB | predicted |")
    print("|---|---|---|---|---|---|---|")
    try:
        for budget in args.budgets:
            masked.MASKED_SCORE_BUDGET_BYTES = budget * 2**20
            times = {"forward": [], "backward": []}
            peaks = {}
            for _ in range(args.repeats):
                with measure_peak("cpu") as peak:
                    start = time.perf_counter()
                    out, lse = masked.masked_block_forward(q, k, v, positions, positions, spec, 0.125,
                                                           key_valid_BS=valid)
                    times["forward"].append(time.perf_counter() - start)
                peaks["forward"] = peak.extra_bytes
                with measure_peak("cpu") as peak:
                    start = time.perf_counter()
                    masked.masked_block_backward(grad_out, q, k, v, lse, None, out, positions, positions, spec,
                                                 0.125, key_valid_BS=valid)
                    times["backward"].append(time.perf_counter() - start)
                peaks["backward"] = peak.extra_bytes
                del out, lse
            predicted = {op: masked_kernel_bytes(op, spec, S, S, B, H, H, D, 4) for op in times}
            print(f"| {budget} | {min(times['forward']):.3f} | {peaks['forward'] / 2**20:.0f} | "
                  f"{predicted['forward'] / 2**20:.0f} | {min(times['backward']):.3f} | "
                  f"{peaks['backward'] / 2**20:.0f} | {predicted['backward'] / 2**20:.0f} |", flush=True)
    finally:
        masked.MASKED_SCORE_BUDGET_BYTES = default


if __name__ == "__main__":
    main()
