"""One training step of a tiny Llama on P gloo ranks, traced (``burstc.compile(..., trace=dir)``), drawn as a
timeline: one band per rank, with lanes for the ring op, each ring step's compute, the calls that post and wait
for its transfers (the exposed communication, red), and the transfers themselves by direction and peer.  Prints
each rank's measured overlap fraction (ring transfer time hidden behind ring compute).

    python benchmarks/timeline.py                                   # P = 2, S = 8K: docs/timeline.png
    python benchmarks/timeline.py --ranks 4 --out docs/timeline-p4.png
    /work/shared/tools/emulated-cluster/emulated-cluster --ranks 2 --rate 50 -- \\
        python benchmarks/timeline.py --label "flat 50 MB/s link (emulated)"

The step drawn is the second (the first compiles); its window runs from the model's call to the end of the
optimizer step.  The trace files stay in ``--trace-dir`` (open them in https://ui.perfetto.dev).
"""
from __future__ import annotations

import argparse
import json
import re
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from burstc.testing import WorkerGroup  # noqa: E402

STEP = re.compile(r"ring (fwd|bwd) step (\d+) ")
CALL = re.compile(r"ring (fwd|bwd) (post|wait) step (\d+)$")
TRANSFER = re.compile(r"ring (fwd|bwd) (send|recv) step (\d+) (to|from) rank (\d+) ")
RING_OP = re.compile(r"burstc::ring_attention_(forward|backward)$")
COLOURS = {"fwd": "#4c72b0", "bwd": "#55a868", "post": "#dd8452", "wait": "#c44e52", "send": "#8172b3",
           "recv": "#937860", "op_forward": "#c6d4ea", "op_backward": "#cde6d2"}


def step_task(rank, world_size, args, trace_dir):
    """Two training steps (the second traced); this rank's step time and measured overlap."""
    import burstc
    from burstc import timeline
    from burstc.testing.zoo.titan import TitanLlama, TitanLlamaArgs, WithLoss
    from torch.distributed.device_mesh import init_device_mesh

    torch._dynamo.reset()
    torch.manual_seed(0)
    model = WithLoss(TitanLlama(TitanLlamaArgs(dim=args.dim, n_layers=args.layers, n_heads=args.heads,
                                               n_kv_heads=args.kv_heads, vocab_size=args.vocab,
                                               max_seq_len=args.seq_len + 1)))
    cmodel = burstc.compile(model, init_device_mesh("cpu", (world_size,)), backend=args.backend, trace=trace_dir)
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
    ids = torch.randint(0, args.vocab, (1, args.seq_len + 1), generator=torch.Generator().manual_seed(1))
    seconds = []
    for _ in range(2):
        torch.distributed.barrier()
        start = time.perf_counter()
        cmodel(ids[:, :-1], ids[:, 1:]).backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        seconds.append(time.perf_counter() - start)
    timeline.flush()
    window = burstc.report(cmodel).traces[-1]
    stats = window.stats
    return dict(rank=rank, path=str(window.path), step_s=seconds[-1], overlap=stats.overlap,
                transfer_s=stats.transfer_s, hidden_s=stats.hidden_s, exposed_s=stats.exposed_s,
                ring_calls=len(stats.calls), bytes_sent=sum(c.total_bytes_sent for c in stats.calls))


def lanes_of(path) -> tuple[dict[str, list[tuple[float, float, str]]], float, float]:
    """A trace file -> lane name -> ``(start_us, duration_us, colour key)``, and the window's first and last
    event times (µs)."""
    events = [e for e in json.loads(Path(path).read_text())["traceEvents"] if e.get("ph") == "X"]
    lanes: dict[str, list] = {"ring op": [], "ring step compute": [], "post / wait": []}
    for event in events:
        name, span = event["name"], (event["ts"], event["dur"])
        if m := RING_OP.search(name):
            lanes["ring op"].append((*span, f"op_{m[1]}"))
        elif m := STEP.match(name):
            lanes["ring step compute"].append((*span, m[1]))
        elif m := CALL.match(name):
            lanes["post / wait"].append((*span, m[2]))
        elif m := TRANSFER.match(name):
            lane = f"sends to {m[5]}" if m[2] == "send" else f"receives from {m[5]}"
            lanes.setdefault(lane, []).append((*span, m[2]))
    start = min(e["ts"] for e in events)
    stop = max(e["ts"] + e["dur"] for e in events)
    return lanes, start, stop


def draw(results, args, out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    per_rank = [lanes_of(r["path"]) for r in results]
    origin = min(start for _, start, _ in per_rank)
    end = max(stop for _, _, stop in per_rank)
    rows = sum(len(lanes) for lanes, _, _ in per_rank) + len(per_rank) - 1
    height_in = 0.32 * rows + 1.8
    fig, ax = plt.subplots(figsize=(16, height_in))
    y, ticks, labels = 0, [], []
    for result, (lanes, _, _) in zip(results, per_rank):
        for lane, spans in lanes.items():
            bars = [((s - origin) / 1e6, d / 1e6) for s, d, _ in spans]
            ax.broken_barh(bars, (y - 0.4, 0.8), facecolors=[COLOURS[key] for _, _, key in spans],
                       edgecolor="white", linewidth=0.6)  # adjacent steps stay apart
            ticks.append(y)
            labels.append(f"rank {result['rank']}: {lane}")
            y -= 1
        y -= 1  # a gap between ranks
    ax.set_yticks(ticks, labels, fontsize=8)
    ax.set_xlim(0, (end - origin) / 1e6)
    ax.set_xlabel("seconds since the traced call")
    overlaps = ", ".join(f"rank {r['rank']} {r['overlap']:.2f}" for r in results)
    ax.set_title(f"one training step, tiny Llama ({args.layers} layers, dim {args.dim}, {args.heads} heads, "
                 f"S = {args.seq_len}) on {len(results)} gloo ranks{', ' + args.label if args.label else ''}\n"
                 f"overlap (ring transfer time hidden behind ring compute): {overlaps}", fontsize=10)
    legend = [Patch(color=COLOURS[k], label=text) for k, text in (
        ("op_forward", "ring op (forward)"), ("op_backward", "ring op (backward)"), ("fwd", "forward step compute"),
        ("bwd", "backward step compute"), ("post", "posting transfers"), ("wait", "waiting (exposed)"),
        ("send", "send (posted -> waited)"), ("recv", "receive (posted -> waited)"))]
    fig.legend(handles=legend, loc="lower center", ncol=4, fontsize=8, frameon=False)
    ax.grid(axis="x", alpha=0.3)
    fig.tight_layout(rect=(0, 0.45 / height_in, 1, 1))  # the legend's two lines below the axes
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=110)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--seq-len", type=int, default=8192)
    parser.add_argument("--dim", type=int, default=256)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--kv-heads", type=int, default=4)
    parser.add_argument("--vocab", type=int, default=4096)
    parser.add_argument("--backend", default="aot_eager")
    parser.add_argument("--out", default="docs/timeline.png")
    parser.add_argument("--trace-dir", default=None, help="where the trace files go (default: a new temp dir)")
    parser.add_argument("--label", default="", help="what the link is, for the title (e.g. the emulated rate)")
    args = parser.parse_args()
    trace_dir = args.trace_dir or tempfile.mkdtemp(prefix="burstc-timeline-")
    with WorkerGroup(args.ranks, run_timeout_s=1800) as group:
        results = group.run(step_task, args, trace_dir)
    print(f"S={args.seq_len}, P={args.ranks}, dim={args.dim}, layers={args.layers}, heads={args.heads}/"
          f"{args.kv_heads}, backend={args.backend}{', ' + args.label if args.label else ''}; the second step")
    print("| rank | step (s) | ring calls | bytes sent | transfers (s) | hidden (s) | exposed (s) | overlap |")
    print("|---|---|---|---|---|---|---|---|")
    for r in results:
        print(f"| {r['rank']} | {r['step_s']:.2f} | {r['ring_calls']} | {r['bytes_sent'] / 2**20:.1f} MiB "
              f"| {r['transfer_s']:.3f} | {r['hidden_s']:.3f} | {r['exposed_s']:.3f} | {r['overlap']:.2f} |")
    print(f"traces: {', '.join(r['path'] for r in results)}")
    draw(results, args, Path(args.out))
    print(f"timeline: {args.out}")


if __name__ == "__main__":
    main()
