"""Ring attention on a nodes x ranks-per-node mesh: burstc's double ring vs its flat ring vs torch's ring.

Meant to run under the emulated cluster, which rate-limits gloo traffic per rank pair with slower links
between nodes than inside one (``../shared/tools/emulated-cluster``, its README has the calibration)::

    EC=../shared/tools/emulated-cluster/emulated-cluster
    $EC --nodes 2 --gpus-per-node 2 --intra 101 --inter 11.3 -- \
        python benchmarks/topology.py --mesh 2x2 --seq-lens 16384 --intra-mbps 101 --inter-mbps 11.3
    python benchmarks/topology.py --mesh 2x2 --seq-lens 16384      # no network limit: compute alone
    $EC ... -- python benchmarks/topology.py --model --seq-lens 16384 ...   # a Llama training step per ring=

Causal attention forward + backward, zigzag layout, the same sharded inputs for every implementation:

* ``burstc_double``: ``ring_attention(..., group_or_mesh=mesh_2d, ring="double")`` (:mod:`burstc.ops.double_ring`);
* ``burstc_ulysses``: ``ring="ulysses"``, all-to-all inside each node and the ring across nodes
  (:mod:`burstc.ops.ulysses`);
* ``burstc_flat``: the same op over the flattened mesh (``ring="flat"``: every rank sends its block straight
  to each other rank, so G (N - 1) blocks per rank cross nodes);
* ``torch_ring``: PyTorch's ``_templated_ring_attention`` over the whole world, head-tail balanced
  (as in ``benchmarks/ring_attention.py``).

Columns: step time (best and median of interleaved rounds, slowest rank), bytes per rank per call split
into intra- and inter-node (burstc: its counters per link class, the flat ring's split by the peer of
each step; torch: its ring's hops, the ranks r -> r + 1 whose nodes differ), the communication-only bound
``max(intra bytes / intra rate, inter bytes / inter rate)`` when the rates are given, and max abs error vs
single-device fp32 SDPA.
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
sys.path.insert(0, str(Path(__file__).resolve().parent))

from burstc.attention_ir import MaskSpec  # noqa: E402
from burstc.testing import WorkerGroup  # noqa: E402
from ring_attention import DTYPES, _leaves, run_torch_ring, shard_with_reference  # noqa: E402  (benchmarks/ring_attention.py)

IMPLS = ("burstc_double", "burstc_ulysses", "burstc_flat", "torch_ring")


@dataclasses.dataclass(frozen=True)
class Config:
    nodes: int
    per_node: int
    seq_len: int
    heads_q: int
    heads_kv: int
    head_dim: int
    dtype: str
    iters: int
    impls: tuple[str, ...]
    reference: bool = True

    @property
    def world_size(self) -> int:
        return self.nodes * self.per_node


_MESHES = {}


def _mesh(config: Config):
    from torch.distributed.device_mesh import init_device_mesh

    key = (config.nodes, config.per_node)
    if key not in _MESHES:
        _MESHES[key] = init_device_mesh("cpu", key, mesh_dim_names=("inter", "intra"))
    return _MESHES[key]


def _run_burstc(kind: str):
    def run(q, k, v, grad_out, config):
        from burstc.ops.ring_attention import record_stats, ring_attention

        q_, k_, v_ = _leaves(q, k, v)
        with record_stats() as stats:
            out = ring_attention(q_, k_, v_, group_or_mesh=_mesh(config), causal=True, layout="zigzag", ring=kind)
            out.backward(grad_out)
        links = stats.bytes_sent_by_link
        if "ring" in links:  # the flat ring counts one class: split it by each step's peer
            links = _flat_links(config, dist.get_rank(), stats)
        if kind == "ulysses":  # the counters see the ring across nodes; the all-to-alls stay inside the node
            from burstc.cost_model import ulysses_bytes

            links["intra"] = sum(ulysses_bytes(config.seq_len // config.world_size, config.per_node, 1, config.heads_q,
                                               config.heads_kv, config.head_dim, DTYPES[config.dtype]))
        return out, q_.grad, k_.grad, v_.grad, {"links": links, "plan": stats.of("backward")[0].plan}
    return run


def _flat_links(config: Config, rank: int, stats) -> dict[str, int]:
    """The flat ring's bytes per link class, by the peer of each of its sends (the planner's split, checked
    against the op's own per-step counters)."""
    from burstc.planner import predicted_transfers

    links = {"intra": 0, "inter": 0}
    for call in stats.calls:
        predicted = predicted_transfers("zigzag", MaskSpec.causal(), config.seq_len, config.world_size, 1,
                                        config.heads_q, config.heads_kv, config.head_dim, DTYPES[config.dtype],
                                        per_node=config.per_node)["forward" if call.op == "forward" else call.plan]
        assert list(predicted.sent_per_step[rank]) == list(call.bytes_sent_per_step), call.op
        for link, nbytes in predicted.sent_by_link[rank].items():
            links[link] += nbytes
    return links


def _run_torch_ring(q, k, v, grad_out, config):
    out, dq, dk, dv, _ = run_torch_ring(q, k, v, grad_out, dist.group.WORLD)
    return out, dq, dk, dv, {"links": _torch_ring_links(config, q), "plan": "torch"}


def _torch_ring_links(config: Config, q) -> dict[str, int]:
    """torch's ring, all-to-all rotation: each of P - 1 forward steps passes K, V to rank + 1; the backward
    passes K, V again and the fp32 dK, dV P times (``convert_to_f32``)."""
    rank, size = dist.get_rank(), config.world_size
    local = config.seq_len // size
    kv = 2 * local * config.heads_kv * config.head_dim * q.element_size()
    dkv = 2 * local * config.heads_kv * config.head_dim * 4
    link = "inter" if (rank // config.per_node) != ((rank + 1) % size) // config.per_node else "intra"
    return {link: 2 * (size - 1) * kv + size * dkv}


RUNNERS = {"burstc_double": _run_burstc("double"), "burstc_ulysses": _run_burstc("ulysses"),
           "burstc_flat": _run_burstc("flat"), "torch_ring": _run_torch_ring}


def _measured_flops(q, k, v) -> float:
    """Attention FLOP/s of this rank while every rank computes (a shard against a shard, forward + backward,
    at the cost model's 14 D FLOPs per score entry), the best of three."""
    q_, k_, v_ = _leaves(q, k, v)
    entries = q.shape[0] * q.shape[1] * q.shape[2] * k.shape[2]
    best = math.inf
    for _ in range(3):
        dist.barrier()
        started = time.perf_counter()
        F.scaled_dot_product_attention(q_, k_, v_, enable_gqa=True).sum().backward()
        best = min(best, time.perf_counter() - started)
    return 14 * q.shape[3] * entries / best


def _bench_task(rank, world_size, config: Config):
    dtype = DTYPES[config.dtype]
    generator = torch.Generator().manual_seed(0)
    q, grad_out = (torch.randn(1, config.heads_q, config.seq_len, config.head_dim, generator=generator).to(dtype)
                   for _ in range(2))
    k, v = (torch.randn(1, config.heads_kv, config.seq_len, config.head_dim, generator=generator).to(dtype)
            for _ in range(2))
    local, reference = shard_with_reference(q, k, v, grad_out, rank, world_size, config.reference)
    rows = {"_flops": _measured_flops(local[0], local[1], local[2])}
    for impl in config.impls:
        result = RUNNERS[impl](*local, config)  # warm-up, and the numbers for the error columns
        rows[impl] = {"wall_s": [], **result[4]}
        if reference is not None:
            errors = [(got.float() - want).abs().max().item() for got, want in zip(result[:4], reference)]
            rows[impl]["error"] = max(e if math.isfinite(e) else math.inf for e in errors)
    for _ in range(config.iters):
        for impl in config.impls:  # interleaved rounds: load on the shared machine hits all alike
            dist.barrier()
            started = time.perf_counter()
            RUNNERS[impl](*local, config)
            dist.barrier()
            rows[impl]["wall_s"].append(time.perf_counter() - started)
    return rows


def _combine(per_rank: list[dict], impl: str, rates: tuple[float, float] | None, config: Config) -> dict:
    rows = [r[impl] for r in per_rank]
    walls = [max(r["wall_s"][i] for r in rows) for i in range(len(rows[0]["wall_s"]))]
    intra = max(r["links"].get("intra", 0) for r in rows)
    inter = max(r["links"].get("inter", 0) for r in rows)
    combined = {"wall_s": min(walls), "wall_median_s": sorted(walls)[len(walls) // 2], "intra_bytes": intra,
                "inter_bytes": inter, "plan": rows[0]["plan"], "error": max(r.get("error", 0.0) for r in rows)}
    if rates is not None:
        combined["comm_bound_s"] = _busiest_link_s({"intra": intra, "inter": inter}, rates)
    if impl.startswith("burstc_"):
        from burstc.cost_model import Machine, predicted_ring_cost

        flops = min(r["_flops"] for r in per_rank)
        bandwidth = (("intra", rates[0] * 1e6), ("inter", rates[1] * 1e6)) if rates else (("intra", 1e15), ("inter", 1e15))
        cost = predicted_ring_cost(impl.removeprefix("burstc_"), "zigzag", MaskSpec.causal(), config.seq_len,
                                   config.nodes, config.per_node, 1, config.heads_q, config.heads_kv, config.head_dim,
                                   DTYPES[config.dtype], combined["plan"], Machine(flops, bandwidth))
        combined.update(predicted_s=cost.total, compute_s=cost.compute, gflops=flops / 1e9)
    return combined


def _table(config: Config, results: dict, rates) -> str:
    head = (f"mesh {config.nodes}x{config.per_node} S={config.seq_len} Hq={config.heads_q} Hkv={config.heads_kv} "
            f"D={config.head_dim} {config.dtype} causal zigzag | measured attention "
            f"{results['burstc_double']['gflops'] if 'burstc_double' in results else 0:.1f} GFLOP/s per rank | links: "
            + (f"intra {rates[0]} MB/s, inter {rates[1]} MB/s" if rates else "not limited")
            + f" | load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores")
    lines = [head, "| impl | plan | step s (best) | step s (median) | model: predicted s / compute-only s "
                   "| intra MiB/rank | inter MiB/rank | comm-only bound s | max error | vs burstc_double |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    ours = results.get("burstc_double")
    for impl, row in results.items():
        bound = f"{row['comm_bound_s']:.2f}" if "comm_bound_s" in row else "-"
        ratio = f"{row['wall_s'] / ours['wall_s']:.2f}x" if ours else "-"
        model = f"{row['predicted_s']:.2f} / {row['compute_s']:.2f}" if "predicted_s" in row else "-"
        lines.append(f"| {impl} | {row['plan']} | {row['wall_s']:.2f} | {row['wall_median_s']:.2f} | {model} "
                     f"| {row['intra_bytes'] / 2**20:.1f} | {row['inter_bytes'] / 2**20:.1f} | {bound} "
                     f"| {row['error']:.1e} | {ratio} |")
    return "\n".join(lines)


MODEL_RINGS = ("double", "ulysses", "flat")


def _model_task(rank, world_size, config: Config, dim: int, layers: int, rings: tuple[str, ...],
                without: tuple[str, ...] = (), reduce_grads: bool = True, overlap_memory_bytes: int | None = None):
    """Training steps (forward, backward, AdamW) of a torchtitan-style Llama compiled with each ``ring``: the
    best step time of ``config.iters`` after a compiling one, the loss, and the ring each attention ran.  Each
    ring again with the passes ``without`` disabled (an A/B of those passes in the same run), rows
    ``"<ring> without <passes>"``; the variants alternate step by step, so load drifts hit both alike."""
    import burstc
    from burstc.ops.ring_attention import record_stats
    from burstc.testing.zoo.titan import TitanLlama, TitanLlamaArgs, WithLoss

    rows = {}
    vocab = 4096
    ids = torch.randint(0, vocab, (1, config.seq_len + 1), generator=torch.Generator().manual_seed(1))
    for ring in rings:
        variants = {ring: ()}
        if without:
            variants[f"{ring} without {'+'.join(without)}"] = tuple(without)
        runs = {}
        for label, disabled in variants.items():
            torch._dynamo.reset()
            torch.manual_seed(0)
            model = WithLoss(TitanLlama(TitanLlamaArgs(dim=dim, n_layers=layers, n_heads=config.heads_q,
                                                       n_kv_heads=config.heads_kv, vocab_size=vocab,
                                                       max_seq_len=config.seq_len + 1))).to(DTYPES[config.dtype])
            cmodel = burstc.compile(model, _mesh(config), backend="aot_eager", ring=ring, disable_passes=disabled,
                                    reduce_grads=reduce_grads, overlap_memory_bytes=overlap_memory_bytes)
            runs[label] = {"model": cmodel, "optimizer": torch.optim.AdamW(model.parameters(), lr=1e-4),
                           "times": []}
        for step in range(config.iters + 1):
            # the variants take turns going first: the first of a pair ran ~5% slower in an A/A run (same options)
            for label, run in (reversed if step % 2 else iter)(list(runs.items())):
                dist.barrier()
                with record_stats() as stats:
                    started = time.perf_counter()
                    loss = run["model"](ids[:, :-1], ids[:, 1:])
                    loss.backward()
                    run["optimizer"].step()
                    run["optimizer"].zero_grad(set_to_none=True)
                    dist.barrier()
                if step:  # the first step compiles
                    run["times"].append(time.perf_counter() - started)
                run["loss"], run["stats"] = float(loss.detach()), stats
        for label, run in runs.items():
            report, stats, times = burstc.report(run["model"]), run["stats"], run["times"]
            # the last step's ring calls: bytes this rank sent per link class, and each call's time and compute
            rows[label] = {"wall_s": min(times), "last_s": times[-1], "loss": run["loss"],
                           "sent": stats.bytes_sent_by_link,
                           "calls": [(c.op, c.wall_s, c.compute_s, dict(c.bytes_sent_by_link)) for c in stats.calls],
                           "exposed_s": sum(sum(c.exposed_s_per_step) for c in stats.calls),
                           # the backward's hops after its P compute steps (two on a double ring)
                           "hop_exposed_s": sum(sum(c.exposed_s_per_step[c.world_size:]) for c in stats.calls
                                                if c.op == "backward"),
                           "rings": sorted({r.details.get("ring") for r in report.rewrites_of("attention")})}
    return rows


def _busiest_link_s(sent: dict[str, int], rates) -> float:
    """Seconds the busiest of the ``intra`` / ``inter`` link classes needs for ``sent`` bytes at ``rates`` MB/s."""
    rate_of = {"intra": rates[0], "inter": rates[1]}
    return max((n / (rate_of[link] * 1e6) for link, n in sent.items() if link in rate_of), default=0.0)


def _dependency_floor(row: dict, rates) -> dict:
    """One rank's last step split into its ring calls and the rest, and the floor no overlap inside a ring call can
    beat: each call at max(its compute, its busiest link's bytes / rate) — a layer's attention needs its own inputs
    and the next layer its output, so a call can hide its transfers only behind its own compute — plus the rest."""
    ring_s = {"forward": 0.0, "backward": 0.0}
    compute_s, floor = dict(ring_s), 0.0
    for op, wall_s, call_compute_s, sent in row["calls"]:
        ring_s[op] += wall_s
        compute_s[op] += call_compute_s
        floor += max(call_compute_s, _busiest_link_s(sent, rates))
    other = row["last_s"] - sum(ring_s.values())
    return {"step_s": row["last_s"], "ring_s": ring_s, "compute_s": compute_s, "other_s": other,
            "floor_s": floor + other}


def _model_table(config: Config, per_rank: list[dict], dim: int, layers: int, rates) -> str:
    head = (f"training step (fwd+bwd+AdamW), torchtitan Llama dim={dim} layers={layers} Hq={config.heads_q} "
            f"Hkv={config.heads_kv}, mesh {config.nodes}x{config.per_node}, S={config.seq_len} {config.dtype} | links: "
            + (f"intra {rates[0]} MB/s, inter {rates[1]} MB/s" if rates else "not limited")
            + f" | load average {os.getloadavg()[0]:.1f}")
    lines = [head, "| ring= | ran | step s (best, slowest rank) | loss | vs double | MiB sent/rank (busiest) by link "
                   "| comm-only bound s | ring waits exposed s (backward last hops), most of a rank |",
             "|---|---|---|---|---|---|---|---|"]
    rows = {ring: {"wall_s": max(r[ring]["wall_s"] for r in per_rank), "loss": per_rank[0][ring]["loss"],
                   "rings": per_rank[0][ring]["rings"],
                   "exposed": max(r[ring].get("exposed_s", 0.0) for r in per_rank),
                   "hop_exposed": max(r[ring].get("hop_exposed_s", 0.0) for r in per_rank),
                   "sent": {link: max(r[ring]["sent"].get(link, 0) for r in per_rank)
                            for link in sorted({link for r in per_rank for link in r[ring]["sent"]})}}
            for ring in per_rank[0]}
    base = rows.get("double", next(iter(rows.values())))["wall_s"]
    for ring, row in rows.items():
        sent = ", ".join(f"{link} {nbytes / 2**20:.1f}" for link, nbytes in row["sent"].items()) or "-"
        bound = "-"
        if rates and "ring" not in row["sent"]:  # each link class at its rate, in parallel (a flat ring's "ring"
            bound = f"{_busiest_link_s(row['sent'], rates):.2f}"  # bytes mix both classes: no bound given)
        lines.append(f"| {ring} | {', '.join(map(str, row['rings']))} | {row['wall_s']:.2f} | {row['loss']:.6f} "
                     f"| {row['wall_s'] / base:.2f}x | {sent} | {bound} "
                     f"| {row['exposed']:.2f} ({row['hop_exposed']:.2f}) |")
    if rates and all("inter" in r[ring]["sent"] for r in per_rank for ring in rows):
        lines.append("\nthe last step per rank: ring calls (their compute) and the rest; the dependency floor "
                     "(each ring call at max(compute, busiest link bytes / rate), plus the rest):")
        for ring in rows:
            for rank, r in enumerate(per_rank):
                f = _dependency_floor(r[ring], rates)
                lines.append(f"  {ring} rank {rank}: step {f['step_s']:.2f} s = forward ring {f['ring_s']['forward']:.2f} "
                             f"({f['compute_s']['forward']:.2f}) + backward ring {f['ring_s']['backward']:.2f} "
                             f"({f['compute_s']['backward']:.2f}) + rest {f['other_s']:.2f}; floor {f['floor_s']:.2f} s, "
                             f"step {f['step_s'] / f['floor_s']:.2f}x of it")
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--mesh", default="2x2", help="nodes x ranks per node")
    parser.add_argument("--seq-lens", type=int, nargs="+", default=[16384])
    parser.add_argument("--heads", nargs="+", default=["4:4"], help="query:key-value heads, one or more (4:4 8:2 ...)")
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--dtypes", nargs="+", choices=sorted(DTYPES), default=["fp32"])
    parser.add_argument("--iters", type=int, default=2, help="timed rounds after one warm-up")
    parser.add_argument("--impls", nargs="+", choices=IMPLS, default=list(IMPLS))
    parser.add_argument("--intra-mbps", type=float, help="the emulated intra-node rate (for the comm-only bound)")
    parser.add_argument("--inter-mbps", type=float, help="the emulated inter-node rate")
    parser.add_argument("--no-reference", action="store_true")
    parser.add_argument("--json", type=Path)
    parser.add_argument("--model", action="store_true",
                        help="a training step of a torchtitan-style Llama per ring= instead of the op alone")
    parser.add_argument("--dim", type=int, default=512, help="--model: hidden size")
    parser.add_argument("--layers", type=int, default=4, help="--model: decoder layers")
    parser.add_argument("--rings", nargs="+", choices=MODEL_RINGS, default=list(MODEL_RINGS),
                        help="--model: the ring= values to time")
    parser.add_argument("--without", nargs="+", default=[], metavar="PASS",
                        help="--model: each ring also with these passes disabled (e.g. overlap_ring_backward), "
                             "timed in the same run")
    parser.add_argument("--no-reduce-grads", action="store_true",
                        help="--model: compile with reduce_grads=False (the gradients' all-reduce left to the caller, "
                             "as under FSDP: not timed)")
    parser.add_argument("--overlap-memory-bytes", type=int, default=None,
                        help="--model: burstc's overlap_memory_bytes option (default: automatic)")
    args = parser.parse_args(argv)
    nodes, per_node = (int(x) for x in args.mesh.lower().split("x"))
    rates = (args.intra_mbps, args.inter_mbps) if args.intra_mbps and args.inter_mbps else None
    all_rows = []
    if args.model:
        with WorkerGroup(nodes * per_node, run_timeout_s=6 * 3600) as workers:
            for seq_len in args.seq_lens:
                for heads in args.heads:
                    heads_q, heads_kv = (int(x) for x in heads.split(":"))
                    for dtype in args.dtypes:
                        config = Config(nodes, per_node, seq_len, heads_q, heads_kv, args.dim // heads_q, dtype,
                                        args.iters, ())
                        per_rank = workers.run(_model_task, config, args.dim, args.layers, tuple(args.rings),
                                               tuple(args.without), not args.no_reduce_grads,
                                               args.overlap_memory_bytes)
                        print(_model_table(config, per_rank, args.dim, args.layers, rates), "\n", flush=True)
                        all_rows.append({"config": dataclasses.asdict(config), "rates_mbps": rates,
                                         "results": per_rank})
        if args.json:
            args.json.write_text(json.dumps(all_rows, indent=2))
        return 0
    with WorkerGroup(nodes * per_node, run_timeout_s=6 * 3600) as workers:
        for seq_len in args.seq_lens:
            for heads in args.heads:
                heads_q, heads_kv = (int(x) for x in heads.split(":"))
                for dtype in args.dtypes:
                    impls = tuple(impl for impl in args.impls if impl != "burstc_ulysses"
                                  or not (heads_q % per_node or heads_kv % per_node))
                    config = Config(nodes, per_node, seq_len, heads_q, heads_kv, args.head_dim, dtype,
                                    args.iters, impls, reference=not args.no_reference)
                    started = time.perf_counter()
                    per_rank = workers.run(_bench_task, config)
                    results = {impl: _combine(per_rank, impl, rates, config) for impl in config.impls}
                    print(_table(config, results, rates), flush=True)
                    agreement = _planner_agreement(results)
                    if agreement:
                        print(agreement["line"], flush=True)
                    print(f"(took {time.perf_counter() - started:.0f} s)\n", flush=True)
                    all_rows.append({"config": dataclasses.asdict(config), "rates_mbps": rates, "results": results,
                                     "planner": agreement})
    agreed = [row["planner"]["agrees"] for row in all_rows if row["planner"]]
    if agreed:
        print(f"planner's choice within 5% of the measured best in {sum(agreed)} of {len(agreed)} configurations "
              f"({100 * sum(agreed) / len(agreed):.0f}%)")
    if args.json:
        args.json.write_text(json.dumps(all_rows, indent=2))
    return 0


def _planner_agreement(results: dict) -> dict | None:
    """The cost model's choice among burstc's plans (lowest predicted seconds, with the measured compute rate
    and the given link rates) against the measured best: it agrees when its step is within 5% of the best."""
    ours = {impl: row for impl, row in results.items() if impl.startswith("burstc_") and "predicted_s" in row}
    if len(ours) < 2:
        return None
    chosen = min(ours, key=lambda impl: ours[impl]["predicted_s"])
    best = min(ours, key=lambda impl: ours[impl]["wall_s"])
    ratio = ours[chosen]["wall_s"] / ours[best]["wall_s"]
    return {"chosen": chosen, "best": best, "ratio": ratio, "agrees": ratio <= 1.05,
            "line": f"planner picks {chosen}, measured best {best}: {ratio:.2f}x its step "
                    f"({'agrees' if ratio <= 1.05 else 'DISAGREES'})"}


if __name__ == "__main__":
    raise SystemExit(main())
