"""A padded batch whose rows disagree in length, on P gloo ranks: the ring with batch groups (the default,
:mod:`burstc.ops.batch_groups`) against the whole batch as one group, forward + backward, interleaved rounds.

    python benchmarks/padded_batch.py                            # P = 4, S = 16K, rows S, S/2, S/4, S/8
    python benchmarks/padded_batch.py --P 2 --S 2048 --iters 1   # a smoke run

Every row holds the same q, k, v, dO; each batch row is a real sequence right-padded (``--lengths``: fractions of S;
negative: left-padded) under causal & key padding, zigzag.  Columns: step seconds (slowest rank; best and median of
the rounds), MiB sent per rank (fwd + bwd, the busiest), evaluated score entries (the kernels' rectangles, fwd +
bwd, max over ranks), the forward's received bytes against the zero-redundancy bounds, each the max over ranks (the
batch's union: a row travels where some batch row needs it; per batch row: where each row's own queries need
it), and the error
against single-device SDPA on the first round (``--no-reference`` skips).  Under the emulated network
(``../shared/tools/emulated-cluster``) the same command measures the transfers too.
"""
from __future__ import annotations

import argparse
import os
import time

import torch

from burstc import layout as layouts
from burstc.attention_ir import KeyPadding, MaskSpec
from burstc.ops import ring_attention as ra
from burstc.ops.batch_groups import batch_groups_forced, batch_row_groups
from burstc.ops.ring_loops import MaskData
from burstc.planner import data_zero_redundancy_bound
from burstc.testing.workers import WorkerGroup

MASK = MaskSpec.causal() & KeyPadding("attention_mask")
ROWS = {"batch groups (default)": None, "one group": 1}


def _key_valid(seq_len: int, lengths: list[float]) -> torch.Tensor:
    valid = torch.zeros(len(lengths), seq_len, dtype=torch.bool)
    for b, fraction in enumerate(lengths):
        real = max(1, round(abs(fraction) * seq_len))
        if fraction < 0:
            valid[b, seq_len - real:] = True
        else:
            valid[b, :real] = True
    return valid


def _inputs(args):
    generator = torch.Generator().manual_seed(args.seed)
    batch = len(args.lengths)
    q, grad_out = (torch.randn(batch, args.heads, args.S, args.head_dim, generator=generator) for _ in range(2))
    k, v = (torch.randn(batch, args.heads, args.S, args.head_dim, generator=generator) for _ in range(2))
    return q, k, v, grad_out, _key_valid(args.S, args.lengths)


def _reference_error(q, k, v, grad_out, valid, out, leaves, mine) -> float:
    leaves_full = [t.double().requires_grad_() for t in (q, k, v)]
    visible = MASK.visible(torch.arange(q.shape[2]), torch.arange(q.shape[2]), kv_valid=valid).unsqueeze(1)
    want = torch.nn.functional.scaled_dot_product_attention(*leaves_full, attn_mask=visible)
    want.backward(grad_out.double())
    got = [out] + [t.grad for t in leaves]
    ref = [want] + [t.grad for t in leaves_full]
    return max(float((a.detach().double() - b.detach().index_select(2, mine)).abs().max()) for a, b in zip(got, ref))


def _task(rank: int, world_size: int, args) -> dict:
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // world_size))
    q, k, v, grad_out, valid = _inputs(args)
    mine = layouts.local_positions(args.S, world_size, rank, "zigzag")
    results = {}
    for round_index in range(args.iters + 1):  # round 0 warms up and counts
        for row, forced in ROWS.items():
            leaves = [t.index_select(2, mine).requires_grad_() for t in (q, k, v)]
            torch.distributed.barrier()
            started = time.perf_counter()
            with batch_groups_forced(forced), ra.record_stats() as stats:
                out = ra.ring_attention(*leaves, mask=MASK, layout="zigzag", key_valid=valid)
                out.backward(grad_out.index_select(2, mine))
            seconds = time.perf_counter() - started
            entry = results.setdefault(row, {"step_s": []})
            if round_index == 0:
                forward, backward = stats.of("forward")[0], stats.of("backward")[0]
                entry.update(bytes=forward.total_bytes_sent + backward.total_bytes_sent,
                             forward_received=sum(forward.bytes_received_per_step),
                             entries=sum(forward.kernel_entries_per_step) + sum(backward.kernel_entries_per_step),
                             plan=backward.plan)
                if not args.no_reference:
                    entry["error"] = _reference_error(q, k, v, grad_out, valid, out, leaves, mine)
            else:
                entry["step_s"].append(seconds)
    return results


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--P", type=int, default=4)
    parser.add_argument("--S", type=int, default=16384)
    parser.add_argument("--lengths", type=float, nargs="+", default=[1.0, 0.5, 0.25, 0.125],
                        help="each batch row's real length as a fraction of S (negative: left-padded)")
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--iters", type=int, default=2, help="timed rounds after the warm-up round")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--no-reference", action="store_true", help="skip the single-device error check")
    args = parser.parse_args(argv)
    valid = _key_valid(args.S, args.lengths)
    groups = batch_row_groups(MaskData(None, valid), len(args.lengths))
    shape = (len(args.lengths), args.heads, args.heads, args.head_dim, torch.float32)
    bounds = {name: data_zero_redundancy_bound("zigzag", MASK, args.S, args.P, *shape, key_valid_BS=valid,
                                               per_batch_row=per_row)["forward"]
              for name, per_row in (("union", False), ("per row", True))}
    print(f"P={args.P} S={args.S} B={len(args.lengths)} (lengths {args.lengths} x S) H={args.heads} "
          f"D={args.head_dim} fp32, causal & key padding, zigzag; batch groups "
          f"{[g.rows if isinstance(g.rows, slice) else g.rows.tolist() for g in groups]}; load average "
          f"{os.getloadavg()[0]:.1f} on {os.cpu_count()} cores", flush=True)
    with WorkerGroup(args.P, run_timeout_s=6 * 3600) as workers:
        per_rank = workers.run(_task, args)
    print("| row | step s (best) | step s (median) | MiB sent/rank | evaluated entries (max rank) "
          "| fwd MiB received / union bound / per-row bound (max rank) | bwd plan | max error |")
    print("|---|---|---|---|---|---|---|---|")
    for row in ROWS:
        ranks = [r[row] for r in per_rank]
        steps = [max(r["step_s"][i] for r in ranks) for i in range(args.iters)]
        error = f"{max(r['error'] for r in ranks):.1e}" if "error" in ranks[0] else "-"
        mib = lambda n: n / 2**20  # noqa: E731
        print(f"| {row} | {min(steps):.2f} | {sorted(steps)[len(steps) // 2]:.2f} "
              f"| {mib(max(r['bytes'] for r in ranks)):.1f} | {max(r['entries'] for r in ranks):,} "
              f"| {mib(max(r['forward_received'] for r in ranks)):.1f} / {mib(max(bounds['union'])):.1f} / "
              f"{mib(max(bounds['per row'])):.1f} | {ranks[0]['plan']} | {error} |", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
