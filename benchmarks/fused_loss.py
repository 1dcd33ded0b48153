"""LM head + cross-entropy, forward + backward: eager vs torch's chunked F.linear_cross_entropy vs Apple CCE
(torch_compile) vs burstc's fused op, on CPU.

Every (shape, dtype, variant) runs in its own subprocess, so peak memory and compile caches do not leak between
variants. Per variant it reports:

- time: median wall time of ``--repeats`` warmed-up steps (forward + backward, grads set to None before each);
  with ``--rounds R`` the variant list runs R times interleaved and each variant keeps its best round (the
  machine may be shared);
- peak extra memory: VmHWM - VmRSS around one warmed-up step (``/proc/self/clear_refs`` reset with "5" just
  before it), i.e. what the step adds on top of inputs and parameters. Workers run with
  MALLOC_MMAP_THRESHOLD_ fixed (``--mmap-threshold-kib``, default 1024) so every large buffer is mmapped and given
  back on free; with glibc's adaptive threshold, buffers under 32 MiB freed during warm-up stay resident and hide
  from the next step's high-water mark, which flatters exactly the chunked variants;
- loss error: |loss - ref| / |ref| and gradient errors ||g - ref|| / ||ref|| against an fp64 reference evaluated
  at the same input-dtype logits (F.cross_entropy on fp64 logit chunks, gradients straight through the rounding),
  computed once per (shape, dtype) in its own subprocess and cached under ``--cache-dir``.

Examples:
    python benchmarks/fused_loss.py --quick
    python benchmarks/fused_loss.py --tokens 4096 16384 --hidden 256 1024 --vocab 32768 65536 --dtype fp32 bf16
    python benchmarks/fused_loss.py --shapes 4096x256x32768 16384x1024x65536 --dtype fp32 bf16 --repeats 2 --rounds 2
"""
from __future__ import annotations

import argparse
import gc
import itertools
import json
import math
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

DTYPES = {"fp32": "float32", "bf16": "bfloat16"}
VARIANTS = ("eager", "torch_chunked", "torch_chunked_256", "cce_compile", "burstc")
IGNORE_INDEX = -100
IGNORED_FRACTION = 0.05
LOGIT_STD = 2.0
SEED = 0


# ---------------------------------------------------------------------------------------------------------------------
# worker side


def _proc_status_kib(field: str) -> int:
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise RuntimeError(f"{field} not in /proc/self/status")


def _reset_peak_rss() -> None:
    with open("/proc/self/clear_refs", "w") as clear_refs:
        clear_refs.write("5")  # resets VmHWM to the current RSS


def _make_inputs(tokens: int, hidden: int, vocab: int, dtype):
    import torch

    generator = torch.Generator().manual_seed(SEED)
    hidden_NH = torch.randn(tokens, hidden, generator=generator).to(dtype)
    weight_VH = (torch.randn(vocab, hidden, generator=generator) * (LOGIT_STD / math.sqrt(hidden))).to(dtype)
    target_N = torch.randint(0, vocab, (tokens,), generator=generator)
    ignored = torch.rand(tokens, generator=generator) < IGNORED_FRACTION
    target_N[ignored] = IGNORE_INDEX
    return hidden_NH.requires_grad_(), weight_VH.requires_grad_(), target_N


def _variant_fn(variant: str):
    import torch
    import torch.nn.functional as F

    if variant == "eager":
        return lambda h, w, t: F.cross_entropy(F.linear(h, w).float(), t, ignore_index=IGNORE_INDEX)
    if variant.startswith("torch_chunked"):
        if variant == "torch_chunked":  # defaults; CPU auto policy: "accurate", "aspect_ratio" chunking
            options = torch.nn.LinearCrossEntropyOptions()
        else:  # explicit 256-row chunks: much faster on CPU than aspect_ratio's (4096 / (V / H) rounded up) rows
            options = torch.nn.LinearCrossEntropyOptions(chunking_method=None, batch_chunk_size=256)
        return lambda h, w, t: F.linear_cross_entropy(h, w, t, ignore_index=IGNORE_INDEX, options=options)
    if variant == "cce_compile":
        from cut_cross_entropy import linear_cross_entropy as cce_linear_cross_entropy

        return lambda h, w, t: cce_linear_cross_entropy(h, w, t, ignore_index=IGNORE_INDEX, impl="torch_compile")
    if variant == "burstc":
        from burstc.ops.linear_cross_entropy import linear_cross_entropy

        return lambda h, w, t: linear_cross_entropy(h, w, t, ignore_index=IGNORE_INDEX)
    raise ValueError(variant)


def _reference_path(cache_dir: Path, tokens: int, hidden: int, vocab: int, dtype_name: str) -> Path:
    return cache_dir / f"ref_seed{SEED}_{tokens}x{hidden}x{vocab}_{dtype_name}.pt"


def compute_reference(tokens: int, hidden: int, vocab: int, dtype_name: str, path: Path, chunk: int = 256) -> None:
    """fp64 loss and grads at the input-dtype logits, chunk by chunk (never the full fp64 [N, V])."""
    import torch
    import torch.nn.functional as F

    dtype = getattr(torch, DTYPES[dtype_name])
    hidden_NH, weight_VH, target_N = _make_inputs(tokens, hidden, vocab, dtype)
    hidden_NH, weight_VH = hidden_NH.detach(), weight_VH.detach()
    weight64 = weight_VH.double().requires_grad_()
    grad_hidden64 = torch.empty(tokens, hidden, dtype=torch.float64)
    loss_sum = torch.zeros((), dtype=torch.float64)
    for start in range(0, tokens, chunk):
        hidden_c = hidden_NH[start:start + chunk]
        hidden64 = hidden_c.double().requires_grad_()
        rounded = F.linear(hidden_c, weight_VH).double()  # the logits every variant sees
        exact = F.linear(hidden64, weight64)
        logits = rounded + (exact - exact.detach())
        chunk_loss = F.cross_entropy(logits, target_N[start:start + chunk], ignore_index=IGNORE_INDEX,
                                     reduction="sum")
        chunk_loss.backward()
        grad_hidden64[start:start + chunk] = hidden64.grad
        loss_sum += chunk_loss.detach()
    count = int((target_N != IGNORE_INDEX).sum())
    torch.save({"loss": float(loss_sum / count), "grad_hidden": (grad_hidden64 / count).float(),
                "grad_weight": (weight64.grad / count).float()}, path)


def run_worker(args) -> dict:
    import torch

    torch.set_num_threads(args.threads)
    dtype = getattr(torch, DTYPES[args.dtype])
    hidden_NH, weight_VH, target_N = _make_inputs(args.tokens, args.hidden, args.vocab, dtype)
    loss_fn = _variant_fn(args.variant)

    def step():
        hidden_NH.grad = weight_VH.grad = None
        loss = loss_fn(hidden_NH, weight_VH, target_N)
        loss.backward()
        return loss.detach()

    warmup_start = time.perf_counter()
    for _ in range(args.warmup):
        step()
    warmup_s = time.perf_counter() - warmup_start

    hidden_NH.grad = weight_VH.grad = None
    gc.collect()
    rss_before_kib = _proc_status_kib("VmRSS")
    _reset_peak_rss()
    loss = step()
    peak_extra_kib = _proc_status_kib("VmHWM") - rss_before_kib

    times = []
    for _ in range(args.repeats):
        start = time.perf_counter()
        step()
        times.append(time.perf_counter() - start)

    reference = torch.load(args.reference, weights_only=True)
    loss_value = float(loss)
    grad_errors = {}
    for name, grad in (("grad_hidden", hidden_NH.grad), ("grad_weight", weight_VH.grad)):
        expected = reference[name].double()
        grad_errors[name] = float((grad.double() - expected).norm() / expected.norm())
    return {
        "variant": args.variant,
        "tokens": args.tokens, "hidden": args.hidden, "vocab": args.vocab, "dtype": args.dtype,
        "time_s": statistics.median(times), "times_s": times, "warmup_s": warmup_s,
        "peak_extra_mib": peak_extra_kib / 1024,
        "loss": loss_value, "loss_dtype": str(loss.dtype).replace("torch.", ""),
        "loss_rel_err": abs(loss_value - reference["loss"]) / abs(reference["loss"]),
        **{f"{name}_rel_err": value for name, value in grad_errors.items()},
    }


# ---------------------------------------------------------------------------------------------------------------------
# driver side


def _estimated_peak_bytes(variant: str, tokens: int, vocab: int, dtype_name: str) -> int:
    element = 4 if dtype_name == "fp32" else 2
    if variant == "eager":  # logits (input dtype) + fp32 upcast + log-softmax + fp32 grad + input-dtype grad
        return tokens * vocab * (element * 2 + 4 * 3)
    if variant == "cce_compile":  # measured: ~2 (bf16) / ~4 (fp32) bytes per logit at 4096 x 32768
        return tokens * vocab * element * 2
    return 0


def _mem_available_bytes() -> int:
    with open("/proc/meminfo") as meminfo:
        for line in meminfo:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    return 0


def _spawn(argv: list[str], env: dict, timeout: float) -> tuple[int, str, str]:
    result = subprocess.run([sys.executable, __file__, *argv], capture_output=True, text=True, env=env,
                            timeout=timeout)
    return result.returncode, result.stdout, result.stderr


def _parse_shapes(args) -> list[tuple[int, int, int]]:
    if args.quick:
        return [(4096, 256, 32768)]
    if args.shapes:
        return [tuple(int(part) for part in shape.split("x")) for shape in args.shapes]
    return list(itertools.product(args.tokens, args.hidden, args.vocab))


def _format_table(rows: list[dict]) -> str:
    header = (f"{'tokens':>6} {'hidden':>6} {'vocab':>6} {'dtype':>5} {'variant':>17} {'time s':>8} "
              f"{'peak MiB':>9} {'loss rel err':>12} {'dh rel err':>10} {'dW rel err':>10} {'loss dtype':>10}")
    lines = [header, "-" * len(header)]
    for row in rows:
        if "error" in row:
            lines.append(f"{row['tokens']:>6} {row['hidden']:>6} {row['vocab']:>6} {row['dtype']:>5} "
                         f"{row['variant']:>17}  {row['error']}")
            continue
        lines.append(
            f"{row['tokens']:>6} {row['hidden']:>6} {row['vocab']:>6} {row['dtype']:>5} {row['variant']:>17} "
            f"{row['time_s']:>8.3f} {row['peak_extra_mib']:>9.1f} {row['loss_rel_err']:>12.2e} "
            f"{row['grad_hidden_rel_err']:>10.2e} {row['grad_weight_rel_err']:>10.2e} {row['loss_dtype']:>10}"
        )
    return "\n".join(lines)


def _format_ratios(rows: list[dict]) -> str:
    lines = ["", "burstc ratios (targets: mem/eager <= 0.125, mem/torch_chunked* <= 1.5, time/cce <= 1.0, "
             "loss rel err ~ fp32 eps):"]
    keyed = {}
    for row in rows:
        if "error" not in row:
            keyed[(row["tokens"], row["hidden"], row["vocab"], row["dtype"], row["variant"])] = row
    for (tokens, hidden, vocab, dtype, variant), row in keyed.items():
        if variant != "burstc":
            continue
        parts = [f"{tokens}x{hidden}x{vocab} {dtype}:"]
        for other, quantity, label in (("eager", "peak_extra_mib", "mem/eager"),
                                       ("torch_chunked", "peak_extra_mib", "mem/torch_chunked"),
                                       ("torch_chunked_256", "peak_extra_mib", "mem/torch_chunked_256"),
                                       ("cce_compile", "time_s", "time/cce"),
                                       ("torch_chunked", "time_s", "time/torch_chunked"),
                                       ("torch_chunked_256", "time_s", "time/torch_chunked_256"),
                                       ("eager", "time_s", "time/eager")):
            other_row = keyed.get((tokens, hidden, vocab, dtype, other))
            if other_row is not None and other_row[quantity] > 0:
                parts.append(f"{label} {row[quantity] / other_row[quantity]:.3f}")
        parts.append(f"loss rel err {row['loss_rel_err']:.1e}")
        lines.append("  " + "  ".join(parts))
    return "\n".join(lines)


def run_driver(args) -> None:
    import importlib.util

    variants = list(args.variants)
    if "cce_compile" in variants and importlib.util.find_spec("cut_cross_entropy") is None:
        print("note: cut-cross-entropy is not installed (pip install cut-cross-entropy); skipping cce_compile")
        variants.remove("cce_compile")
    cache_dir = Path(args.cache_dir)
    cache_dir.mkdir(parents=True, exist_ok=True)
    env = dict(os.environ)
    if args.mmap_threshold_kib > 0:
        env["MALLOC_MMAP_THRESHOLD_"] = str(args.mmap_threshold_kib * 1024)
        env["MALLOC_TRIM_THRESHOLD_"] = str(args.mmap_threshold_kib * 1024)
    repo_root = str(Path(__file__).resolve().parents[1])
    env["PYTHONPATH"] = repo_root + os.pathsep + env.get("PYTHONPATH", "")
    rows = []
    for (tokens, hidden, vocab), dtype_name in itertools.product(_parse_shapes(args), args.dtype):
        rows.extend(_run_shape(args, variants, env, cache_dir, tokens, hidden, vocab, dtype_name))
    print()
    print(_format_table(rows))
    print(_format_ratios(rows))
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=2))


def _run_shape(args, variants, env, cache_dir, tokens, hidden, vocab, dtype_name) -> list[dict]:
    """All variants at one (shape, dtype), ``--rounds`` times interleaved; time = best round's median."""
    rows_by_variant: dict[str, list[dict]] = {variant: [] for variant in variants}
    for _ in range(args.rounds):
        for row in _run_shape_once(args, variants, env, cache_dir, tokens, hidden, vocab, dtype_name):
            rows_by_variant[row["variant"]].append(row)
    merged = []
    for variant, runs in rows_by_variant.items():
        good = [run for run in runs if "error" not in run]
        if not good:
            merged.append(runs[0])
            continue
        best = dict(min(good, key=lambda run: run["time_s"]))
        best["round_times_s"] = [run["time_s"] for run in good]
        best["peak_extra_mib"] = statistics.median(run["peak_extra_mib"] for run in good)
        merged.append(best)
    return merged


def _run_shape_once(args, variants, env, cache_dir, tokens, hidden, vocab, dtype_name) -> list[dict]:
    rows = []
    shape_argv = ["--tokens", str(tokens), "--hidden", str(hidden), "--vocab", str(vocab), "--dtype", dtype_name]
    reference = _reference_path(cache_dir, tokens, hidden, vocab, dtype_name)
    if not reference.exists():
        started = time.perf_counter()
        code, _, stderr = _spawn(["--reference-worker", str(reference), *shape_argv], env, args.timeout)
        if code != 0:
            raise RuntimeError(f"reference failed for {tokens}x{hidden}x{vocab} {dtype_name}:\n{stderr[-3000:]}")
        print(f"[reference {tokens}x{hidden}x{vocab} {dtype_name}: {time.perf_counter() - started:.0f} s]",
              flush=True)
    for variant in variants:
        base = {"tokens": tokens, "hidden": hidden, "vocab": vocab, "dtype": dtype_name, "variant": variant}
        if variant in ("eager", "cce_compile"):
            need = _estimated_peak_bytes(variant, tokens, vocab, dtype_name)
            if need > 0.7 * _mem_available_bytes():
                rows.append({**base, "error": f"skipped: needs ~{need / 2**30:.1f} GiB of logits"})
                print(_format_table(rows[-1:]).splitlines()[-1], flush=True)
                continue
        argv = ["--worker", "--variant", variant, "--reference", str(reference), "--repeats", str(args.repeats),
                "--warmup", str(args.warmup), "--threads", str(args.threads), *shape_argv]
        try:
            code, stdout, stderr = _spawn(argv, env, args.timeout)
        except subprocess.TimeoutExpired:
            rows.append({**base, "error": f"timeout after {args.timeout} s"})
            continue
        if code != 0:
            last = (stderr.strip().splitlines() or ["?"])[-1]
            rows.append({**base, "error": f"failed: {last[:150]}"})
        else:
            rows.append(json.loads(stdout.strip().splitlines()[-1]))
        print(_format_table(rows[-1:]).splitlines()[-1], flush=True)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="one shape: 4096 x 256 x 32768")
    parser.add_argument("--tokens", type=int, nargs="+", default=[4096, 16384])
    parser.add_argument("--hidden", type=int, nargs="+", default=[256, 1024])
    parser.add_argument("--vocab", type=int, nargs="+", default=[32768, 65536])
    parser.add_argument("--shapes", nargs="+", help="explicit TOKENSxHIDDENxVOCAB list (overrides the grid)")
    parser.add_argument("--dtype", nargs="+", choices=sorted(DTYPES), default=["fp32", "bf16"])
    parser.add_argument("--variants", nargs="+", choices=VARIANTS, default=list(VARIANTS))
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--rounds", type=int, default=1,
                        help="run the variant list this many times, interleaved, and keep each variant's best "
                             "round (robust to other load on the machine)")
    parser.add_argument("--warmup", type=int, default=2, help="warm-up steps (compilation happens here)")
    parser.add_argument("--threads", type=int, default=max(1, os.cpu_count() or 1))
    parser.add_argument("--mmap-threshold-kib", type=int, default=1024,
                        help="MALLOC_MMAP_THRESHOLD_ for the workers (0: glibc default, adaptive)")
    parser.add_argument("--timeout", type=float, default=3600)
    parser.add_argument("--cache-dir", default=os.path.join(tempfile.gettempdir(), "burstc_fused_loss_reference"))
    parser.add_argument("--json", help="also write the rows here")
    # internal
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--reference-worker", help=argparse.SUPPRESS)
    parser.add_argument("--variant", help=argparse.SUPPRESS)
    parser.add_argument("--reference", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.reference_worker:
        compute_reference(args.tokens[0], args.hidden[0], args.vocab[0], args.dtype[0], Path(args.reference_worker))
    elif args.worker:
        args.tokens, args.hidden, args.vocab, args.dtype = args.tokens[0], args.hidden[0], args.vocab[0], args.dtype[0]
        print(json.dumps(run_worker(args)))
    else:
        run_driver(args)


if __name__ == "__main__":
    main()
