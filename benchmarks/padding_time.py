"""Key padding, timed: ring attention (forward + backward) of left-padded batches on P gloo ranks with the padding
given to the op (``KeyPadding`` data: K/V rows that are padding in every batch row stay home and their blocks are
skipped) against the same call without it (every row travels and every block is computed: what ignoring the padding
costs).  Run it under the emulated cluster to see the bytes as time, e.g.

    EC=/work/shared/tools/emulated-cluster/emulated-cluster
    $EC --ranks 4 --rate 11.3 -- python benchmarks/padding_time.py

Prints per padding case the slowest rank's best step time and bytes received per rank, both ways, and the ratio.
"""
from __future__ import annotations

import argparse
import time

import torch

from burstc.testing import WorkerGroup


def _step(rank, world_size, seq_len, heads, head_dim, fractions, with_padding, iters):
    from burstc import layout as layouts
    from burstc.attention_ir import KeyPadding, MaskSpec
    from burstc.ops.ring_attention import record_stats, ring_attention

    gen = torch.Generator().manual_seed(0)
    batch = len(fractions)
    q, k, v, grad = (torch.randn(batch, heads, seq_len, head_dim, generator=gen) for _ in range(4))
    key_valid = torch.ones(batch, seq_len, dtype=torch.bool)
    for row, fraction in enumerate(fractions):
        key_valid[row, :int(seq_len * fraction)] = False
    shard = lambda t: layouts.shard(t, 2, world_size, rank, "zigzag")  # noqa: E731
    q_l, k_l, v_l = (shard(t).requires_grad_() for t in (q, k, v))
    mask = MaskSpec.causal() & KeyPadding("attention_mask") if with_padding else MaskSpec.causal()
    extra = {"key_valid": key_valid} if with_padding else {}
    times, received = [], 0
    for _ in range(iters + 1):  # the first is a warm-up
        torch.distributed.barrier()
        started = time.perf_counter()
        with record_stats() as stats:
            out = ring_attention(q_l, k_l, v_l, mask=mask, layout="zigzag", plan="kv_ring", **extra)
            out.backward(shard(grad))
        times.append(time.perf_counter() - started)
        received = sum(sum(c.bytes_received_per_step) for c in stats.calls)
        q_l.grad = k_l.grad = v_l.grad = None
    return min(times[1:]), received


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--ranks", type=int, default=4)
    parser.add_argument("--seq-len", type=int, default=8192)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--iters", type=int, default=2)
    args = parser.parse_args(argv)
    print(f"causal, zigzag, kv_ring, P = {args.ranks}, S = {args.seq_len}, {args.heads} heads x {args.head_dim}, fp32, "
          f"two left-padded rows; forward + backward, best of {args.iters} after a warm-up, slowest rank")
    print("| left padding of the two rows | padding given: step s | MiB received/rank | padding ignored: step s "
          "| MiB received/rank | time ratio | bytes ratio |")
    print("|---|---|---|---|---|---|---|")
    with WorkerGroup(args.ranks, run_timeout_s=3600) as workers:
        for fractions in ((0.25, 0.35), (0.5, 0.1), (0.05, 0.05)):
            found = {}
            for with_padding in (True, False):
                ranks = workers.run(_step, args.seq_len, args.heads, args.head_dim, fractions, with_padding,
                                    args.iters)
                found[with_padding] = (max(t for t, _ in ranks), max(b for _, b in ranks))
            (now_s, now_b), (all_s, all_b) = found[True], found[False]
            print(f"| {fractions} | {now_s:.2f} | {now_b / 2**20:.1f} | {all_s:.2f} | {all_b / 2**20:.1f} | "
                  f"{all_s / now_s:.2f}x | {all_b / max(now_b, 1):.2f}x |", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
