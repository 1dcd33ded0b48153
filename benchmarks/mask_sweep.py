"""The HF architecture sweep under real training inputs: every architecture x attention implementation x input
kind, compiled on P gloo ranks and compared with single-device eager (loss and every parameter gradient).

    python benchmarks/mask_sweep.py                         # 55 architectures x {sdpa, eager} x {plain, packed, padded}
    python benchmarks/mask_sweep.py --impls sdpa --inputs packed padded --json out.json

Each cell: ``sharded`` (exact, the graph sequence-parallel, with the masks the ring executed), ``refused: <code>``
(exact, replicated, the first refusal code), ``mismatch`` (a wrong loss or gradient: a bug) or ``error: ...``
(the model itself fails, e.g. an implementation the architecture lacks).  Inputs: ``plain`` = input_ids and
labels; ``packed`` = restarting position_ids (3 documents per row); ``padded`` = batch 2, the second row's last 12
tokens padding (attention_mask); ``left_padded`` = the same rows padded on the left (rows whose every key is
padding: under eager's finfo.min fill they average all keys).
"""
from __future__ import annotations

import argparse
import functools
import json
import sys
import time

import torch

from burstc.testing import WorkerGroup, assert_equivalent, zoo

ARCHITECTURES = list(zoo.HF_ARCHITECTURES)
LOSSES = {"plain": zoo.hf_loss_no_cache, "packed": zoo.hf_loss_packed, "padded": zoo.hf_loss_with_padding,
          "left_padded": zoo.hf_loss_left_padded}
INPUTS = {"plain": zoo.hf_arch_inputs, "packed": zoo.hf_arch_inputs, "padded": zoo.hf_arch_batch_inputs,
          "left_padded": zoo.hf_arch_batch_inputs}


def cell(group, world_size, config_name, impl, kind) -> str:
    try:
        results = assert_equivalent(functools.partial(zoo.hf_arch_variant, config_name, impl), INPUTS[kind],
                                    LOSSES[kind], world_size=world_size, group=group, backend="aot_eager",
                                    expect_sharded=False, timeout=300)
    except AssertionError as why:
        return "mismatch: " + str(why).splitlines()[0][:120]
    except Exception as why:  # noqa: BLE001 - the model itself can't run this way: say so, go on
        return f"error: {type(why).__name__}: {str(why).splitlines()[0][:100] if str(why) else ''}"
    result = results[0]
    if "pipeline.hidden_rows_fallback" in result["skip_codes"]:
        return "refused: pipeline.hidden_rows_fallback"  # this call's hidden rows ran the unsharded graph
    if "shard" in [k for k, _ in result["rewrites"]]:
        masks = sorted({m.split(" ")[0].split("(")[0] if "(" in m.split(" ")[0] and "&" not in m.split(" ")[0]
                        else m.split(" ")[0] for m in result["attention_masks"]})
        return "sharded (" + ", ".join(masks) + ")"
    codes = [c for c in result["skip_codes"] if c.startswith("shard.")] or result["skip_codes"] or ["?"]
    return "refused: " + codes[0]


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--world-size", type=int, default=2)
    parser.add_argument("--impls", nargs="+", default=["sdpa", "eager"])
    parser.add_argument("--inputs", nargs="+", default=list(LOSSES), choices=list(LOSSES))
    parser.add_argument("--architectures", nargs="+", default=ARCHITECTURES)
    parser.add_argument("--json")
    args = parser.parse_args(argv)
    import transformers

    rows, start = [], time.time()
    with WorkerGroup(args.world_size, run_timeout_s=600) as group:
        for name in args.architectures:
            if not hasattr(transformers, name):
                continue
            row = {"architecture": name.removesuffix("Config")}
            for impl in args.impls:
                for kind in args.inputs:
                    row[f"{impl}/{kind}"] = cell(group, args.world_size, name, impl, kind)
            rows.append(row)
            print(" | ".join(str(v) for v in row.values()), flush=True)
    columns = list(rows[0]) if rows else []
    print(f"\n| {' | '.join(columns)} |\n|{'---|' * len(columns)}")
    for row in rows:
        print("| " + " | ".join(row[c] for c in columns) + " |")
    counts = {}
    for row in rows:
        for c in columns[1:]:
            key = row[c].split(" ")[0].rstrip(":")
            counts[key] = counts.get(key, 0) + 1
    print(f"\ncells: {counts}; {time.time() - start:.0f} s")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)
    return 1 if counts.get("mismatch") else 0


if __name__ == "__main__":
    sys.exit(main())
