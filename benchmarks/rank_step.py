"""Where a burstc rank's training step goes on a shared CPU machine: the bench's model (``burstc bench``'s tiny HF
Llama, AdamW) on 2 gloo ranks at S, its timed steps interleaved with two controls in the same processes:

* ``2 x eager S/2``: both rank processes run one-process eager on S/2 tokens at the same time, with no
  communication: what two busy processes get from this machine;
* ``eager S``: one process, the whole sequence (the bench's ``eager`` row).

Per row (median over rounds, slowest rank): wall, the main thread's CPU time, its run-queue wait (runnable but not
running, ``/proc/thread-self/schedstat``) and the rest (blocked: communication waits), per token.  ``--breakdown``
adds the main thread's CPU time in burstc's pieces (attention block kernels, the ring ops around them, the fused
loss, AdamW).  ``--lm-head-chunk-size N`` adds a burstc row compiled with that chunk of the fused loss (the old
default at V = 4096, fp32 was min(S / 2, 2048)).

    python benchmarks/rank_step.py --seq-lens 1024 4096 --breakdown
    python benchmarks/rank_step.py --seq-lens 4096 --lm-head-chunk-size 2048
"""
from __future__ import annotations

import argparse
import collections
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from burstc.bench import end_to_end as e2e  # noqa: E402
from burstc.testing import WorkerGroup  # noqa: E402

_STEPS: dict[str, object] = {}
_PIECES: dict[str, list[float]] = collections.defaultdict(lambda: [0.0, 0])  # label -> [CPU s, calls]
_INSTRUMENTED: list[bool] = []


def _schedstat() -> list[int]:
    with open("/proc/thread-self/schedstat") as f:
        return [int(x) for x in f.read().split()]


def _time_piece(module, name: str, label: str) -> None:
    fn = getattr(module, name)

    def timed(*args, **kwargs):
        started = time.thread_time()
        try:
            return fn(*args, **kwargs)
        finally:
            _PIECES[label][0] += time.thread_time() - started
            _PIECES[label][1] += 1
    setattr(module, name, timed)


def _instrument() -> None:
    import burstc.ops.linear_cross_entropy as lce
    import burstc.ops.ring_attention as ra
    import burstc.ops.ring_loops as rl

    _time_piece(rl, "block_attention_forward", "attention block kernels, forward")
    _time_piece(rl, "block_attention_backward", "attention block kernels, backward")
    # The ops call these through ``ring_attention``'s module globals, so they are wrapped there.
    _time_piece(ra, "ring_forward", "ring forward op (kernels, merges, sends)")
    _time_piece(ra, "start_ring_backward", "ring backward op up to its last hop (kernels, sums, sends)")
    _time_piece(lce, "chunked_linear_cross_entropy", "fused LM head + loss")
    _time_piece(torch.optim.AdamW, "step", "AdamW")


def prepare(rank: int, world_size: int, name: str, seq_len: int, options: dict | None, breakdown: bool) -> None:
    import burstc
    from torch.distributed.device_mesh import init_device_mesh

    if breakdown and not _INSTRUMENTED:
        _instrument()
        _INSTRUMENTED.append(True)
    shape = e2e.ModelShape()
    model = e2e.build_model(shape, seq_len, 0)
    ids = e2e.batch_ids(shape, seq_len, 0)
    runner = model if options is None else burstc.compile(model, init_device_mesh("cpu", (world_size,)), **options)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)

    def step():
        e2e.hf_loss(runner, ids).backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    step()  # compiles
    _STEPS[name] = step


def timed_step(rank: int, world_size: int, name: str) -> dict:
    if world_size > 1:
        dist.barrier()
    for piece in _PIECES.values():
        piece[:] = [0.0, 0]
    before = _schedstat()
    wall, cpu = time.perf_counter(), time.thread_time()
    _STEPS[name]()
    wall, cpu, after = time.perf_counter() - wall, time.thread_time() - cpu, _schedstat()
    return {"wall": wall, "cpu": cpu, "runq": (after[1] - before[1]) / 1e9,
            "pieces": {k: v[0] for k, v in _PIECES.items() if v[1]}}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seq-lens", type=int, nargs="+", default=[1024, 4096])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--breakdown", action="store_true")
    parser.add_argument("--lm-head-chunk-size", type=int)
    args = parser.parse_args(argv)
    for seq_len in args.seq_lens:
        with WorkerGroup(2, run_timeout_s=3600) as pair, WorkerGroup(1, run_timeout_s=3600) as single:
            rows = {"burstc": (pair, seq_len // 2)}
            pair.run(prepare, "burstc", seq_len, {}, args.breakdown)
            if args.lm_head_chunk_size:
                rows[f"burstc, lm_head_chunk_size={args.lm_head_chunk_size}"] = (pair, seq_len // 2)
                pair.run(prepare, next(reversed(rows)), seq_len, {"lm_head_chunk_size": args.lm_head_chunk_size},
                         False)
            rows["2 x eager S/2"] = (pair, seq_len // 2)
            pair.run(prepare, "2 x eager S/2", seq_len // 2, None, False)
            rows["eager S"] = (single, seq_len)
            single.run(prepare, "eager S", seq_len, None, False)
            measured = {name: [] for name in rows}
            for _ in range(args.rounds):
                for name, (group, _) in rows.items():
                    per_rank = group.run(timed_step, name)
                    measured[name].append(max(per_rank, key=lambda r: r["wall"]))
        print(f"S = {seq_len}: median of {args.rounds} interleaved rounds, slowest rank, per token of one process")
        for name, (_, tokens) in rows.items():
            steps = measured[name]
            med = {key: statistics.median(s[key] for s in steps) for key in ("wall", "cpu", "runq")}
            print(f"  {name:40s} {tokens:5d} tokens: wall {med['wall'] / tokens * 1e6:6.0f} us (step {med['wall']:.3f} s)"
                  f" = CPU {med['cpu'] / tokens * 1e6:5.0f} + run queue {med['runq'] / tokens * 1e6:5.0f} + blocked "
                  f"{(med['wall'] - med['cpu'] - med['runq']) / tokens * 1e6:5.0f}")
            if name == "burstc" and args.breakdown:
                for piece in steps[0]["pieces"]:
                    cpu = statistics.median(s["pieces"].get(piece, 0.0) for s in steps)
                    print(f"      {piece:44s} CPU {cpu * 1e3:7.1f} ms ({cpu / med['cpu']:.0%})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
