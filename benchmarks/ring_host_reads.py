"""What one ring call reads on the host, per mask (each such read of a device tensor waits for a GPU's queue).

    torchrun --nproc-per-node 2 benchmarks/ring_host_reads.py [--seq-len 1024]

Per call (after a warm-up call that fills the block geometry's caches), forward and backward: the host reads the
ring's decisions make (``tolist``, ``bool``, ``int``, ``float``, ``item``, ``index`` on any tensor; before stop 38
these read the device tensors, now the host copy of the mask data), and the device-to-host read-backs with CPU
tensors playing device ones (``burstc.ops.host_reads``: one per mask tensor, remembered across the step's calls).
The masked kernel's chunk choice reads host positions and is not counted (tests/test_host_reads.py).
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
from test_host_reads import counting_host_reads, cpu_plays_a_device  # noqa: E402

from burstc.attention_ir import Documents, KeyPadding, MaskSpec, SlidingWindow  # noqa: E402
from burstc.ops import host_reads  # noqa: E402
from burstc.ops import ring_attention as ra  # noqa: E402


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seq-len", type=int, default=1024)
    args = parser.parse_args(argv)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    batch, heads, local, dim = 2, 4, args.seq_len // world, 16
    torch.manual_seed(0)
    causal, docs, pad = MaskSpec.causal(), Documents("doc_ids"), KeyPadding("attention_mask")
    doc_ids = (torch.rand(batch, args.seq_len) < 0.01).long().cumsum(1)
    valid = torch.ones(batch, args.seq_len, dtype=torch.bool)
    valid[0, args.seq_len - args.seq_len // 4:] = False
    cases = [("causal", causal, {}), ("window 128", causal & SlidingWindow(128), {}),
             ("causal & padding", causal & pad, {"key_valid": valid}),
             ("causal & documents", causal & docs, {"doc_ids": doc_ids}),
             ("causal & documents & padding", causal & docs & pad, {"doc_ids": doc_ids, "key_valid": valid})]
    if rank == 0:
        print(f"P = {world}, B = {batch}, H = {heads}, S = {args.seq_len}, zigzag\n")
        print("| mask | plan | decision reads fwd / bwd | read-backs per step (CPU playing a device) |")
        print("|---|---|---|---|")
    for name, mask, data in cases:
        for plan in ra.PLANS:
            q, k, v = (torch.randn(batch, heads, local, dim, requires_grad=True) for _ in range(3))
            for _ in range(2):
                with counting_host_reads() as forward_reads:
                    out = ra.ring_attention(q, k, v, mask=mask, layout="zigzag", plan=plan, **data)
                with counting_host_reads() as backward_reads:
                    out.sum().backward()
            with cpu_plays_a_device():
                before = host_reads.read_backs
                ra.ring_attention(q, k, v, mask=mask, layout="zigzag", plan=plan, **data).sum().backward()
                read_backs = host_reads.read_backs - before
            if rank == 0:
                print(f"| {name} | {plan} | {sum(forward_reads.values())} / {sum(backward_reads.values())} | "
                      f"{read_backs} |", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
