"""checkpoint="none" | "layers" | "selective" side by side: one training step of a torchtitan-style Llama on P
gloo ranks, per rank: peak resident memory during the step (``burstc.memory.measure_peak``: VmHWM after
/proc/self/clear_refs, with the heap's free pages trimmed first), step time,
and ring-attention forwards in the backward graph (the recomputed rings).

    python benchmarks/checkpointing.py --seq-len 16384 --ranks 2 --dim 256 --layers 4

Each mode runs in fresh processes (peak memory is per process); the step measured is the second one (the
first compiles).  CPU memory is what the allocator holds: the comparison is between modes of the same run."""
from __future__ import annotations

import argparse
import os
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

MODES = ("none", "layers", "selective")


def _rank(rank, world_size, args, mode, port, out):
    import burstc
    from burstc.testing.zoo.titan import TitanLlama, TitanLlamaArgs, WithLoss
    from torch.distributed.device_mesh import init_device_mesh

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world_size)
    torch.manual_seed(0)
    model = WithLoss(TitanLlama(TitanLlamaArgs(dim=args.dim, n_layers=args.layers, n_heads=args.heads,
                                               n_kv_heads=args.heads, vocab_size=args.vocab,
                                               max_seq_len=args.seq_len + 1)))
    cmodel = burstc.compile(model, init_device_mesh("cpu", (world_size,)), backend=args.backend, checkpoint=mode)
    ids = torch.randint(0, args.vocab, (1, args.seq_len + 1), generator=torch.Generator().manual_seed(1))
    cmodel(ids[:, :-1], ids[:, 1:]).backward()  # compiles
    model.zero_grad(set_to_none=True)
    dist.barrier()
    from burstc.memory import measure_peak

    with measure_peak("cpu") as peak:  # the allocator's cache handed back first: the step's own growth
        start = time.perf_counter()
        loss = cmodel(ids[:, :-1], ids[:, 1:])
        loss.backward()
        seconds = time.perf_counter() - start
    report = burstc.report(cmodel)
    rings = sum(1 for n in report.graphs["backward"].graph.nodes
                if n.op == "call_function" and "ring_attention_forward" in str(n.target))
    out.put((rank, mode, peak.extra_bytes, peak.peak_bytes, seconds, rings, float(loss)))
    dist.barrier()
    dist.destroy_process_group()


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--seq-len", type=int, default=16384)
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--dim", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--vocab", type=int, default=4096)
    parser.add_argument("--backend", default="aot_eager")
    args = parser.parse_args()
    ctx = mp.get_context("spawn")
    rows = []
    for i, mode in enumerate(MODES):
        out = ctx.Queue()
        from burstc.cli import _free_port

        mp.start_processes(_rank, args=(args.ranks, args, mode, _free_port(), out), nprocs=args.ranks,
                           start_method="spawn", join=True)
        results = sorted(out.get() for _ in range(args.ranks))
        rows.append((mode, max(r[2] for r in results), max(r[4] for r in results), results[0][5], results[0][6]))
    print(f"S={args.seq_len}, P={args.ranks}, dim={args.dim}, layers={args.layers}, heads={args.heads}, "
          f"backend={args.backend}; per rank, worst rank; step 2 (after compile)")
    print("| checkpoint | peak memory during the step (MiB) | vs none | step time (s) | vs none | "
          "ring forwards in backward | loss |")
    print("|---|---|---|---|---|---|---|")
    none_mem, none_time = rows[0][1], rows[0][2]
    for mode, mem, seconds, rings, loss in rows:
        print(f"| {mode} | {mem / 2**20:.1f} | {mem / none_mem:.2f}x | {seconds:.2f} | {seconds / none_time:.2f}x "
              f"| {rings} | {loss:.6f} |")


if __name__ == "__main__":
    main()
