"""Causal attention forward+backward on P gloo ranks: burstc ring attention vs its peers, side by side.

    python benchmarks/ring_attention.py                      # P=2, S=16K, MHA+GQA, fp32+bf16
    python benchmarks/ring_attention.py --quick              # small shapes, a smoke run
    python benchmarks/ring_attention.py --world-sizes 2 4 --seq-lens 16384 32768 --json out.json

Implementations (all get the same zigzag / head-tail sharded inputs, chunks r and 2P-1-r on rank r):

* ``burstc``: ``burstc.ops.ring_attention`` (zigzag, planner's backward plan).
* ``torch_ring``: PyTorch's own ring (``burstc.bench.peers.TorchRing``), ``_templated_ring_attention`` /
  ``_templated_ring_attention_backward`` from ``torch.distributed.tensor.experimental._context_parallel._attention``
  driven by the CPU flash ops, head-tail load balance, K/V rotated by all-to-all (a ring); ``torch_ring_allgather``:
  the same with its default all-gather rotation.
* ``lucidrains_zigzag``: ``ring_attention_pytorch.zig_zag_attention.zig_zag_attn`` as shipped (all-gather
  K/V + SDPA with the zigzag causal mask).  Its all-gather backward keeps only the local slice of
  dK/dV (no reduce-scatter), so its dK/dV are per-rank partial sums: see the grad error column.
* ``allgather_kv``: plain torch: all-gather K/V, SDPA of each local chunk against its causal prefix,
  reduce-scatter dK/dV in the backward.
* ``ulysses``: all-to-all (heads <-> sequence) + causal SDPA + all-to-all back; only where the
  heads (incl. KV heads) divide by P.

Columns: time per fwd+bwd step (best and median of interleaved rounds, slowest rank; CPU
seconds of the slowest rank, which a shared, loaded machine disturbs less than wall time), bytes sent per rank per call (burstc: its
byte counter; peers: the exact per-rank bytes of their algorithm, formulas in
``burstc.bench.peers.peer_bytes``),
work balance (max/mean over ranks of score entries computed), max abs error vs single-device fp32
SDPA on the same inputs, and ratios to burstc.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from burstc import layout as layouts  # noqa: E402
from burstc.attention_ir import MaskSpec  # noqa: E402
from burstc.bench.peers import TorchRing, allgather_kv_attention, peer_bytes  # noqa: E402
from burstc.block_geometry import blocks  # noqa: E402
from burstc.planner import masked_plan  # noqa: E402
from burstc.testing import WorkerGroup  # noqa: E402

IMPLS = ("burstc", "torch_ring", "torch_ring_allgather", "lucidrains_zigzag", "allgather_kv", "ulysses")
RING_PEERS = ("torch_ring", "torch_ring_allgather")
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


@dataclasses.dataclass(frozen=True)
class Config:
    world_size: int
    seq_len: int
    batch: int
    heads_q: int
    heads_kv: int
    head_dim: int
    dtype: str
    iters: int
    impls: tuple[str, ...]
    reference: bool = True
    seed: int = 0

    @property
    def attention(self) -> str:
        return "MHA" if self.heads_q == self.heads_kv else f"GQA {self.heads_q // self.heads_kv}:1"


# ---------------------------------------------------------------------------------------------
# Implementations: fn(q, k, v, grad_out, group) -> (out, dq, dk, dv, info)


def _leaves(*tensors):
    return [t.detach().clone().requires_grad_() for t in tensors]


def run_burstc(q, k, v, grad_out, group):
    from burstc.ops.ring_attention import record_stats, ring_attention

    q_, k_, v_ = _leaves(q, k, v)
    with record_stats() as stats:
        out = ring_attention(q_, k_, v_, group_or_mesh=group, causal=True, layout="zigzag", plan="auto")
        out.backward(grad_out)
    (fwd,), (bwd,) = stats.of("forward"), stats.of("backward")
    info = {"bytes_forward": fwd.total_bytes_sent, "bytes_backward": bwd.total_bytes_sent, "plan": bwd.plan,
            "work": fwd.total_work + bwd.total_work}
    return out, q_.grad, k_.grad, v_.grad, info


def _run_torch_ring(q, k, v, grad_out, group, rotate_name):
    from torch.distributed.tensor.experimental._context_parallel._attention import _RotateMethod

    q_, k_, v_ = _leaves(q, k, v)
    out = TorchRing.apply(q_, k_, v_, group, getattr(_RotateMethod, rotate_name))
    out.backward(grad_out)
    return out, q_.grad, k_.grad, v_.grad, {}


def run_torch_ring(q, k, v, grad_out, group):
    return _run_torch_ring(q, k, v, grad_out, group, "ALL_TO_ALL")


def run_torch_ring_allgather(q, k, v, grad_out, group):
    return _run_torch_ring(q, k, v, grad_out, group, "ALL_GATHER")


def run_lucidrains_zigzag(q, k, v, grad_out, group):
    from ring_attention_pytorch.zig_zag_attention import zig_zag_attn

    world_size, rank = dist.get_world_size(group), dist.get_rank(group)
    seq_len = q.shape[2] * world_size
    # the positions its zig_zag_shard returns (rank r: chunks r, 2P-1-r; K/V gathered in rank order)
    q_positions = layouts.local_positions(seq_len, world_size, rank, "zigzag")
    kv_positions = layouts.permutation(seq_len, world_size, "zigzag")
    mask = q_positions[:, None] >= kv_positions[None, :]
    q_, k_, v_ = _leaves(q, k, v)
    out = zig_zag_attn(q_, k_, v_, attn_mask=mask)
    out.backward(grad_out)
    return out, q_.grad, k_.grad, v_.grad, {}


def run_allgather_kv(q, k, v, grad_out, group):
    q_, k_, v_ = _leaves(q, k, v)
    out = allgather_kv_attention(q_, k_, v_, group)
    out.backward(grad_out)
    return out, q_.grad, k_.grad, v_.grad, {}


class _HeadsToSequence(torch.autograd.Function):
    """[B, H, s, D] sharded by sequence -> [B, H/P, P*s, D] sharded by heads (rank order of
    sequence shards); backward is the inverse all-to-all."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _heads_to_sequence(x, group)

    @staticmethod
    def backward(ctx, grad):
        return _sequence_to_heads(grad, ctx.group), None


class _SequenceToHeads(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _sequence_to_heads(x, group)

    @staticmethod
    def backward(ctx, grad):
        return _heads_to_sequence(grad, ctx.group), None


def _heads_to_sequence(x, group):
    world_size = dist.get_world_size(group)
    batch, heads, local_len, head_dim = x.shape
    send = x.reshape(batch, world_size, heads // world_size, local_len, head_dim).transpose(0, 1).contiguous()
    received = torch.empty_like(send)
    dist.all_to_all_single(received, send, group=group)
    return received.permute(1, 2, 0, 3, 4).reshape(batch, heads // world_size, world_size * local_len, head_dim)


def _sequence_to_heads(x, group):
    world_size = dist.get_world_size(group)
    batch, heads_part, seq_len, head_dim = x.shape
    local_len = seq_len // world_size
    send = x.reshape(batch, heads_part, world_size, local_len, head_dim).permute(2, 0, 1, 3, 4).contiguous()
    received = torch.empty_like(send)
    dist.all_to_all_single(received, send, group=group)
    return received.transpose(0, 1).reshape(batch, world_size * heads_part, local_len, head_dim)


def run_ulysses(q, k, v, grad_out, group):
    world_size = dist.get_world_size(group)
    seq_len = q.shape[2] * world_size
    permutation = layouts.permutation(seq_len, world_size, "zigzag")
    inverse = torch.argsort(permutation)
    q_, k_, v_ = _leaves(q, k, v)
    q_h, k_h, v_h = (_HeadsToSequence.apply(t, group).index_select(2, inverse) for t in (q_, k_, v_))
    out_h = F.scaled_dot_product_attention(q_h, k_h, v_h, is_causal=True, enable_gqa=True)
    out = _SequenceToHeads.apply(out_h.index_select(2, permutation), group)
    out.backward(grad_out)
    return out, q_.grad, k_.grad, v_.grad, {}


RUNNERS = {name: globals()[f"run_{name}"] for name in IMPLS}


def _applicable(impl: str, config: Config) -> str | None:
    if impl == "ulysses" and (config.heads_q % config.world_size or config.heads_kv % config.world_size):
        return f"heads {config.heads_q}/{config.heads_kv} not divisible by P={config.world_size}"
    return None


def _peer_bytes(impl: str, config: Config) -> tuple[int, int]:
    """(forward, backward) bytes each rank sends per call, from the peer's algorithm."""
    return peer_bytes(impl, world_size=config.world_size, seq_len=config.seq_len, batch=config.batch,
                      heads_q=config.heads_q, heads_kv=config.heads_kv, head_dim=config.head_dim,
                      element_size=torch.empty((), dtype=DTYPES[config.dtype]).element_size())


def _peer_work(impl: str, config: Config, rank: int) -> int:
    """Score entries each rank computes (forward + backward: backward recomputes the same)."""
    P, BH = config.world_size, config.batch * config.heads_q
    s = config.seq_len // P
    half = s // 2
    if impl in ("torch_ring", "torch_ring_allgather"):  # the same head-tail schedule as burstc: its blocks
        per_call = sum(block.score_entries for kv_owner in range(P)
                       for block in blocks("zigzag", MaskSpec.causal(), rank, kv_owner, s, P))
    elif impl == "lucidrains_zigzag":  # dense mask over all gathered keys
        per_call = s * config.seq_len
    elif impl == "allgather_kv":  # each chunk against its prefix, dense mask
        per_call = half * (rank + 1) * half + half * (2 * P - rank) * half
    elif impl == "ulysses":  # full causal attention for Hq/P heads
        return 2 * config.batch * (config.heads_q // P) * config.seq_len * (config.seq_len + 1) // 2
    else:
        raise KeyError(impl)
    return 2 * BH * per_call


# ---------------------------------------------------------------------------------------------
# Worker task


def _inputs(config: Config):
    generator = torch.Generator().manual_seed(config.seed)
    dtype = DTYPES[config.dtype]
    shape_q = (config.batch, config.heads_q, config.seq_len, config.head_dim)
    shape_kv = (config.batch, config.heads_kv, config.seq_len, config.head_dim)
    q = torch.randn(shape_q, generator=generator).to(dtype)
    k, v = (torch.randn(shape_kv, generator=generator).to(dtype) for _ in range(2))
    grad_out = torch.randn(shape_q, generator=generator).to(dtype)
    return q, k, v, grad_out


def shard_with_reference(q, k, v, grad_out, rank: int, world_size: int, reference: bool):
    """``(this rank's zigzag shards of q, k, v, grad_out; its shards of single-device fp32 causal SDPA's out,
    dq, dk, dv, or None)``."""
    positions = layouts.local_positions(q.shape[2], world_size, rank, "zigzag")
    shard = lambda t: t.index_select(2, positions).contiguous()  # noqa: E731
    shards = None
    if reference:
        q32, k32, v32 = _leaves(*(t.float() for t in (q, k, v)))
        out32 = F.scaled_dot_product_attention(q32, k32, v32, is_causal=True, enable_gqa=True)
        out32.backward(grad_out.float())
        shards = [shard(t) for t in (out32.detach(), q32.grad, k32.grad, v32.grad)]
    return [shard(t) for t in (q, k, v, grad_out)], shards


def _bench_task(rank, world_size, config: Config):
    torch.manual_seed(config.seed)
    group = dist.group.WORLD
    q, k, v, grad_out = _inputs(config)
    local, reference = shard_with_reference(q, k, v, grad_out, rank, world_size, config.reference)
    rows, runnable = {}, []
    for impl in config.impls:
        reason = _applicable(impl, config)
        if reason:
            rows[impl] = {"skipped": reason}
            continue
        runnable.append(impl)
        result = RUNNERS[impl](*local, group)  # warm-up, and the numbers for the error columns
        row = rows[impl] = {"wall_s": [], "cpu_s": [], **result[4]}
        if reference is not None:
            finite = all(bool(torch.isfinite(t).all()) for t in result[:4])
            errors = [(got.float() - want).abs().max().item() if finite else math.inf
                      for got, want in zip(result[:4], reference)]
            row["out_error"], row["grad_error"] = errors[0], max(errors[1:])
        if impl != "burstc":
            row["bytes_forward"], row["bytes_backward"] = _peer_bytes(impl, config)
            row["work"] = _peer_work(impl, config, rank)
        del result
    # Interleaved rounds (every impl once per round) so that load from other processes on a
    # shared machine hits all of them alike; wall time is taken between barriers (slowest rank),
    # CPU time is this process's own (all threads) for the step.
    for _ in range(config.iters):
        for impl in runnable:
            dist.barrier(group)
            wall, cpu = time.perf_counter(), time.process_time()
            RUNNERS[impl](*local, group)
            cpu = time.process_time() - cpu
            dist.barrier(group)
            rows[impl]["wall_s"].append(time.perf_counter() - wall)
            rows[impl]["cpu_s"].append(cpu)
    for impl in runnable:
        rows[impl]["load_average"] = os.getloadavg()[0]
    return rows


# ---------------------------------------------------------------------------------------------
# Driver and report


def _combine(per_rank: list[dict], impl: str) -> dict:
    rows = [r[impl] for r in per_rank]
    if "skipped" in rows[0]:
        return rows[0]
    works = [r["work"] for r in rows]
    walls = [max(r["wall_s"][i] for r in rows) for i in range(len(rows[0]["wall_s"]))]
    combined = {
        "wall_s": min(walls),                                  # best round
        "wall_median_s": sorted(walls)[len(walls) // 2],
        "cpu_s": max(min(r["cpu_s"]) for r in rows),           # slowest rank's best round
        "bytes_forward": max(r["bytes_forward"] for r in rows),
        "bytes_backward": max(r["bytes_backward"] for r in rows),
        "balance": max(works) / (sum(works) / len(works)),
        "plan": rows[0].get("plan", ""),
        "load_average": rows[0]["load_average"],
    }
    if "out_error" in rows[0]:
        combined["out_error"] = max(r["out_error"] for r in rows)
        combined["grad_error"] = max(r["grad_error"] for r in rows)
    return combined


def _format_table(config: Config, results: dict) -> str:
    ours = results["burstc"]
    shape = (config.seq_len, config.world_size, config.batch, config.heads_q, config.heads_kv, config.head_dim,
             DTYPES[config.dtype])
    plan = masked_plan("zigzag", MaskSpec.causal(), *shape)
    other = masked_plan("zigzag", MaskSpec.causal(), *shape, "burst" if plan.plan == "kv_ring" else "kv_ring")
    head = (f"P={config.world_size} S={config.seq_len} B={config.batch} Hq={config.heads_q} Hkv={config.heads_kv} "
            f"D={config.head_dim} {config.dtype} {config.attention} | burstc plan={ours.get('plan')} "
            f"(predicted bwd {plan.sent['backward'] / 2**20:.1f} MiB from the busiest rank, "
            f"{other.plan} {other.sent['backward'] / 2**20:.1f} MiB; the mask-blind ring "
            f"{plan.dense['backward'] / 2**20:.1f} MiB) | load average {ours['load_average']:.1f} on {os.cpu_count()} cores")
    lines = [head,
             "| impl | step s (best) | step s (median) | CPU s/rank | fwd MiB/rank | bwd MiB/rank | balance "
             "| out err | grad err | burstc speedup wall / CPU | bytes vs burstc |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    ours_total = ours["bytes_forward"] + ours["bytes_backward"]
    for impl, row in results.items():
        if "skipped" in row:
            lines.append(f"| {impl} | n/a ({row['skipped']}) | | | | | | | | | |")
            continue
        total = row["bytes_forward"] + row["bytes_backward"]
        err = (f"{row['out_error']:.2e} | {row['grad_error']:.2e}" if "out_error" in row else "- | -")
        lines.append(
            f"| {impl} | {row['wall_s']:.2f} | {row['wall_median_s']:.2f} | {row['cpu_s']:.2f} "
            f"| {row['bytes_forward'] / 2**20:.1f} | {row['bytes_backward'] / 2**20:.1f} | {row['balance']:.2f} | {err} "
            f"| {row['wall_s'] / ours['wall_s']:.2f}x / {row['cpu_s'] / ours['cpu_s']:.2f}x | {total / ours_total:.2f}x |")
    peers = [(impl, results[impl]) for impl in RING_PEERS if impl in results and "skipped" not in results[impl]]
    if peers:
        best_name, best = min(peers, key=lambda item: item[1]["wall_s"])
        lines.append(f"best ring peer (wall): {best_name}: burstc is {best['wall_s'] / ours['wall_s']:.2f}x its speed "
                     f"(CPU {best['cpu_s'] / ours['cpu_s']:.2f}x) with "
                     f"{ours_total / (best['bytes_forward'] + best['bytes_backward']):.2f}x its bytes")
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--world-sizes", type=int, nargs="+", default=[2])
    parser.add_argument("--seq-lens", type=int, nargs="+", default=[16384])
    parser.add_argument("--dtypes", nargs="+", choices=sorted(DTYPES), default=["fp32", "bf16"])
    parser.add_argument("--attention", nargs="+", choices=["mha", "gqa"], default=["mha", "gqa"])
    parser.add_argument("--heads", type=int, default=4, help="query heads (GQA: heads/4 kv heads)")
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--iters", type=int, default=3, help="timed rounds after one warm-up step")
    parser.add_argument("--impls", nargs="+", choices=IMPLS, default=list(IMPLS))
    parser.add_argument("--no-reference", action="store_true", help="skip the single-device reference (errors)")
    parser.add_argument("--quick", action="store_true", help="S=2048, D=64, 1 timed step")
    parser.add_argument("--json", type=Path, help="also write all rows here")
    args = parser.parse_args(argv)
    if args.quick:
        args.seq_lens, args.head_dim, args.iters = [2048], 64, 1
    if "burstc" not in args.impls:
        args.impls = ["burstc", *args.impls]
    all_rows = []
    for world_size in args.world_sizes:
        with WorkerGroup(world_size, run_timeout_s=6 * 3600) as workers:
            for seq_len in args.seq_lens:
                for attention in args.attention:
                    heads_kv = args.heads if attention == "mha" else max(1, args.heads // 4)
                    for dtype in args.dtypes:
                        config = Config(world_size, seq_len, args.batch, args.heads, heads_kv, args.head_dim, dtype,
                                        args.iters, tuple(args.impls), reference=not args.no_reference)
                        started = time.perf_counter()
                        per_rank = workers.run(_bench_task, config)
                        results = {impl: _combine(per_rank, impl) for impl in config.impls}
                        print(_format_table(config, results), flush=True)
                        print(f"(config took {time.perf_counter() - started:.0f} s)\n", flush=True)
                        all_rows.append({"config": {**dataclasses.asdict(config), "attention": config.attention},
                                         "results": results})
    if args.json:
        args.json.write_text(json.dumps(all_rows, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
