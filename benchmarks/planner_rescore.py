"""The cost model's ring choice re-scored on a recorded topology sweep, with a per-message cost added to its links.

``benchmarks/results/topology_sweep/sweep_inter{2.8,11.3,45}.json`` hold the measured steps of the double ring, the
hybrid and the flat ring in 54 configurations under the emulated 2 x 2 cluster (``benchmarks/topology.py``; see the
README's "2-D meshes").  Here each configuration's choice is recomputed with ``Machine.latency`` set to each given
value (seconds per step and link class; ``benchmarks/message_cost.py`` measures it) and compared with the measured
best (agrees within 5%), so the effect of a per-message cost on the choice is known without re-running the sweep.

    python benchmarks/planner_rescore.py 0 0.0003 0.0024 0.01 0.05
    python benchmarks/planner_rescore.py --table      # the README's table: per rate, picks and step ratios
"""
from __future__ import annotations

import argparse
import json
import pathlib

import torch

from burstc.attention_ir import MaskSpec
from burstc.cost_model import Machine, predicted_ring_cost

SWEEP = pathlib.Path(__file__).parent / "results" / "topology_sweep"


def rescore(latency_s: float) -> tuple[int, int, list]:
    """``(agreeing, configurations, misses)`` of the choice with ``latency_s`` per step and link class."""
    agree, total, misses = 0, 0, []
    for path in sorted(SWEEP.glob("sweep_inter*.json")):
        for entry in json.loads(path.read_text()):
            config, results = entry["config"], entry["results"]
            ours = {impl: row for impl, row in results.items() if impl.startswith("burstc_")}
            intra, inter = (rate * 1e6 for rate in entry["rates_mbps"])
            machine = Machine(ours["burstc_double"]["gflops"] * 1e9, (("intra", intra), ("inter", inter)),
                              (("intra", latency_s), ("inter", latency_s)))
            predicted = {impl: predicted_ring_cost(
                impl.removeprefix("burstc_"), "zigzag", MaskSpec.causal(), config["seq_len"], config["nodes"],
                config["per_node"], 1, config["heads_q"], config["heads_kv"], config["head_dim"], torch.float32,
                row["plan"], machine).total for impl, row in ours.items()}
            chosen = min(predicted, key=predicted.get)
            best = min(ours, key=lambda impl: ours[impl]["wall_s"])
            ratio = ours[chosen]["wall_s"] / ours[best]["wall_s"]
            total += 1
            if ratio <= 1.05:
                agree += 1
            else:
                misses.append(f"{entry['rates_mbps'][1]} MB/s S={config['seq_len']} heads {config['heads_q']}:"
                              f"{config['heads_kv']}: picks {chosen}, best {best} ({ratio:.2f}x)")
    return agree, total, misses


def _spread(ratios: list[float]) -> str:
    ratios = sorted(ratios)
    return f"{ratios[len(ratios) // 2]:.2f}x ({ratios[0]:.2f}-{ratios[-1]:.2f})"


def table() -> str:
    """Per recorded rate: the planner's picks within 5% of the measured best (as recorded), and the flat ring's
    and the hybrid's best step over the double ring's (median over the configurations, min-max)."""
    lines = ["| inter-node MB/s | planner's pick within 5% of the best | flat / double step: median (min-max) | "
             "hybrid / double step: median (min-max) |", "|---|---|---|---|"]
    recorded = [(json.loads(path.read_text())) for path in SWEEP.glob("sweep_inter*.json")]
    for entries in sorted(recorded, key=lambda e: e[0]["rates_mbps"][1]):
        step = lambda entry, impl: entry["results"][impl]["wall_s"]  # noqa: E731
        flat = [step(e, "burstc_flat") / step(e, "burstc_double") for e in entries]
        hybrid = [step(e, "burstc_ulysses") / step(e, "burstc_double") for e in entries
                  if "burstc_ulysses" in e["results"]]
        agree = sum(e["planner"]["agrees"] for e in entries)
        lines.append(f"| {entries[0]['rates_mbps'][1]:g} | {agree} / {len(entries)} | {_spread(flat)} | "
                     f"{_spread(hybrid)} |")
    return "\n".join(lines)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("latencies", nargs="*", type=float, default=[0.0, 0.0003, 0.0024, 0.01, 0.05])
    parser.add_argument("--table", action="store_true", help="print the recorded sweep's table and stop")
    args = parser.parse_args(argv)
    if args.table:
        print(table())
        return
    for latency in args.latencies:
        agree, total, misses = rescore(latency)
        print(f"latency {latency * 1e3:.1f} ms per step and link: {agree}/{total} within 5% of the measured best")
        for miss in misses:
            print(f"  {miss}")


if __name__ == "__main__":
    main()
