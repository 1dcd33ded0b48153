"""The fixed cost of one ring step's messages in gloo on this machine: what the cost model's per-message
``latency`` stands for (issue 17).  Each rank posts, like the ring op, receives first then sends, ``--tensors``
tensors of ``--bytes`` each to its neighbour and waits, ``--steps`` times; the median step time of tiny
messages is the fixed cost (the bytes themselves take microseconds at the emulated rates).  Rings: ``flat`` over
all ranks (crossing nodes), ``intra`` (the ranks of a node), ``inter`` (a lane: one rank per node).

    EC=../shared/tools/emulated-cluster/emulated-cluster
    $EC --nodes 2 --gpus-per-node 2 --intra 101 --inter 11.3 -- python benchmarks/message_cost.py --per-node 2
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.distributed as dist

from burstc.testing.workers import WorkerGroup


def _steps(group, tensors: int, numel: int, steps: int) -> list[float]:
    rank, size = group.rank(), group.size()
    right, left = (dist.get_global_rank(group, (rank + d) % size) for d in (1, -1))
    send = [torch.ones(numel) for _ in range(tensors)]
    recv = [torch.empty(numel) for _ in range(tensors)]
    seconds = []
    for _ in range(steps):
        dist.barrier(group)
        started = time.perf_counter()
        ops = [dist.P2POp(dist.irecv, t, left, group) for t in recv] + \
              [dist.P2POp(dist.isend, t, right, group) for t in send]
        for request in dist.batch_isend_irecv(ops):
            request.wait()
        seconds.append(time.perf_counter() - started)
    return seconds


def _task(rank: int, world_size: int, per_node: int, tensors: int, numel: int, steps: int) -> dict:
    torch.set_num_threads(1)
    nodes = world_size // per_node
    intra = [dist.new_group([n * per_node + i for i in range(per_node)]) for n in range(nodes)]
    inter = [dist.new_group([n * per_node + i for n in range(nodes)]) for i in range(per_node)]
    found = {"flat": _steps(dist.group.WORLD, tensors, numel, steps)}
    found["intra"] = _steps(intra[rank // per_node], tensors, numel, steps) if per_node > 1 else []
    found["inter"] = _steps(inter[rank % per_node], tensors, numel, steps) if nodes > 1 else []
    return {ring: statistics.median(s) if s else None for ring, s in found.items()}


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, default=4)
    parser.add_argument("--per-node", type=int, default=2)
    parser.add_argument("--tensors", type=int, default=2, help="messages per direction per step (K and V: 2)")
    parser.add_argument("--bytes", type=int, default=1024)
    parser.add_argument("--steps", type=int, default=50)
    args = parser.parse_args(argv)
    with WorkerGroup(args.ranks) as workers:
        per_rank = workers.run(_task, args.per_node, args.tensors, args.bytes // 4, args.steps)
    for ring in ("flat", "intra", "inter"):
        values = [r[ring] for r in per_rank if r[ring] is not None]
        if values:
            print(f"{ring:5s} ring step, {args.tensors} x {args.bytes} B each way: median over steps, slowest rank "
                  f"{max(values) * 1e3:.2f} ms (ranks {', '.join(f'{v * 1e3:.2f}' for v in values)})")


if __name__ == "__main__":
    main()
