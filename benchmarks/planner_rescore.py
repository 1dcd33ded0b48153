"""The cost model's ring choice re-scored on a recorded topology sweep, with a per-message cost added to its links.

``benchmarks/results/topology_sweep/sweep_inter{2.8,11.3,45}.json`` hold the measured steps of the double ring, the
hybrid and the flat ring in 54 configurations under the emulated 2 x 2 cluster (``benchmarks/topology.py``; see the
README's "2-D meshes").  Here each configuration's choice is recomputed with ``Machine.latency`` set to each given
value (seconds per step and link class; ``benchmarks/message_cost.py`` measures it) and compared with the measured
best (agrees within 5%), so the effect of a per-message cost on the choice is known without re-running the sweep.

    python benchmarks/planner_rescore.py 0 0.0003 0.0024 0.01 0.05
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


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("latencies", nargs="*", type=float, default=[0.0, 0.0003, 0.0024, 0.01, 0.05])
    args = parser.parse_args(argv)
    for latency in args.latencies:
        agree, total, misses = rescore(latency)
        print(f"latency {latency * 1e3:.1f} ms per step and link: {agree}/{total} within 5% of the measured best")
        for miss in misses:
            print(f"  {miss}")


if __name__ == "__main__":
    main()
