"""burstc's per-rank memory model against measurement: one training step of a torchtitan-style Llama on P gloo
ranks, for each checkpoint mode and sequence length, the predicted step peak (``burstc.report(m).memory``) next
to the measured one (``burstc.memory.measure_peak``: VmHWM above the resident memory at the step's start), per
rank; then a ``memory_budget=`` sweep: the mode each budget picks and the measured peak.

    python benchmarks/memory_model.py --seq-lens 2048 4096 8192 --budget-seq-len 4096

Each sequence length runs in fresh processes; the modes and budgets run one after the other in them (a fresh
compile each, the model rebuilt from the same seed).  The step measured is the second (the first compiles),
with the gradients set to None before it.  The workers start with ``MALLOC_MMAP_THRESHOLD_=65536``: glibc then
maps every allocation above 64 KiB on its own and unmaps it when freed, so the resident set follows the live
tensors; with its default (a threshold that grows up to 32 MiB as blocks are freed), freed blocks stay in its
heap and the same step measured 126-153 MiB from step to step where the tensors need ~110 MiB."""
from __future__ import annotations

import argparse
import os

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from burstc.memory import PLANNED_MODES as MODES  # "selective:0.5": checkpoint_keep=0.5

MIB = 2**20


def _build(args, seq_len):
    from burstc.testing.zoo.titan import TitanLlama, TitanLlamaArgs, WithLoss

    torch.manual_seed(0)
    return WithLoss(TitanLlama(TitanLlamaArgs(dim=args.dim, n_layers=args.layers, n_heads=args.heads,
                                              n_kv_heads=args.kv_heads, vocab_size=args.vocab,
                                              max_seq_len=seq_len + 1)))


def _measured_step(args, seq_len, mesh, **options):
    """(measured extra bytes, predicted MemoryEstimate, the report) of the second step under ``options``."""
    import burstc
    from burstc.memory import measure_peak

    torch._dynamo.reset()
    model = _build(args, seq_len)
    cmodel = burstc.compile(model, mesh, backend=args.backend, **options)
    ids = torch.randint(0, args.vocab, (1, seq_len + 1), generator=torch.Generator().manual_seed(1))
    cmodel(ids[:, :-1], ids[:, 1:]).backward()  # compiles
    model.zero_grad(set_to_none=True)
    dist.barrier()
    with measure_peak("cpu") as peak:
        cmodel(ids[:, :-1], ids[:, 1:]).backward()
    report = burstc.report(cmodel)
    return peak.extra_bytes, report.memory, report


def _rank(rank, world_size, args, seq_len, budgets, port, out):
    from torch.distributed.device_mesh import init_device_mesh

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world_size)
    mesh = init_device_mesh("cpu", (world_size,))
    peaks = {}
    for mode in MODES:
        base, _, keep = mode.partition(":")
        measured, estimate, _ = _measured_step(args, seq_len, mesh, checkpoint=base,
                                               **({"checkpoint_keep": float(keep)} if keep else {}))
        peaks[mode] = estimate.peak
        out.put(("mode", seq_len, mode, rank, measured, estimate.step_peak, estimate.peak,
                 estimate.saved_total, f"{estimate.peak_phase} `{estimate.peak_node}`"))
    if budgets == "sweep":  # around and between the modes' predicted peaks (the same on every rank)
        high, low = max(peaks.values()), min(peaks.values())
        budgets = sorted({int(high * 1.1), *(int(p) for p in peaks.values()), (high + low) // 2, int(low * 0.8)},
                         reverse=True)
    for budget in budgets:
        measured, estimate, report = _measured_step(args, seq_len, mesh, memory_budget=budget)
        plan = report.memory_plans[0]
        out.put(("budget", seq_len, budget, rank, measured, plan.mode, plan.fits, estimate.peak))
    dist.barrier()
    dist.destroy_process_group()


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--seq-lens", type=int, nargs="+", default=[2048, 4096, 8192])
    parser.add_argument("--budget-seq-len", type=int, default=4096)
    parser.add_argument("--budgets-mib", type=float, nargs="+", default=None,
                        help="default: each mode's predicted peak, 1.1x the largest, the middle of the largest and "
                             "the smallest, and 0.8x the smallest (nothing fits)")
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--dim", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--kv-heads", type=int, default=4)
    parser.add_argument("--vocab", type=int, default=4096)
    parser.add_argument("--backend", default="aot_eager")
    args = parser.parse_args()
    os.environ["MALLOC_MMAP_THRESHOLD_"] = "65536"  # inherited by the spawned ranks (see the docstring)
    from burstc.cli import _free_port

    ctx = mp.get_context("spawn")
    rows = []
    for seq_len in args.seq_lens:
        budgets = []
        if seq_len == args.budget_seq_len:
            budgets = [int(b * MIB) for b in args.budgets_mib] if args.budgets_mib else "sweep"
        out = ctx.Queue()
        mp.start_processes(_rank, args=(args.ranks, args, seq_len, budgets, _free_port(), out), nprocs=args.ranks,
                           start_method="spawn", join=True)
        while not out.empty():
            rows.append(out.get())
        _print(args, rows, seq_len)


def _print(args, rows, seq_len):
    print(f"\nS={seq_len}, P={args.ranks}, dim={args.dim}, layers={args.layers}, heads={args.heads}/{args.kv_heads}, "
          f"vocab={args.vocab}, backend={args.backend}: one training step per rank, MiB above the resident memory")
    print("| checkpoint | rank | measured | predicted | predicted / measured | predicted peak incl. parameters "
          "| saved activations | peak at |")
    print("|---|---|---|---|---|---|---|---|")
    for row in sorted((r for r in rows if r[0] == "mode" and r[1] == seq_len), key=lambda r: (MODES.index(r[2]), r[3])):
        _, _, mode, rank, measured, step, peak, saved, where = row
        print(f"| {mode} | {rank} | {measured / MIB:.1f} | {step / MIB:.1f} | {step / measured:.3f} | "
              f"{peak / MIB:.1f} | {saved / MIB:.1f} | {where} |")
    budget_rows = sorted((r for r in rows if r[0] == "budget" and r[1] == seq_len), key=lambda r: (-r[2], r[3]))
    if budget_rows:
        print("\n| memory_budget | rank | mode chosen | fits | predicted peak | measured step peak |")
        print("|---|---|---|---|---|---|")
        for _, _, budget, rank, measured, mode, fits, peak in budget_rows:
            print(f"| {budget / MIB:.0f} MiB | {rank} | {mode} | {'yes' if fits else 'no'} | {peak / MIB:.1f} | "
                  f"{measured / MIB:.1f} |")


if __name__ == "__main__":
    main()
