"""One-GPU check of burstc's device kernels: correctness against plain torch, speed against torch's own.

    python benchmarks/gpu_check.py                    # on the first CUDA device, well under 8 minutes on an H100
    python benchmarks/gpu_check.py --out results/gpu  # also writes gpu_check.json and gpu_check.md there
    python benchmarks/gpu_check.py --device cpu --tiny   # the same script at toy sizes on CPU (CI runs this)

Three parts, each row printed as it finishes, a Markdown table at the end:

1. **Kernels vs references** (fresh random inputs, odd shapes, fp32 and bf16; the oracle's tolerance table): the
   ring's block kernels (``burstc.kernels.attention_blocks``: torch's fused flash / memory-efficient kernels on
   CUDA, chosen per block; forward out and LSE, backward dq/dk/dv with the global row statistics) against the
   plain-torch reference in fp64; the fused LM-head loss (Triton on CUDA) against the materialized-logits
   reference in fp64, loss and both gradients.
2. **Timings** (CUDA events, median of a few runs): one square causal block forward + backward through the ring's
   kernel path against ``F.scaled_dot_product_attention`` (flash backend) on the same inputs, in TFLOP/s
   (causal FLOPs: 4·B·H·S²·D/2 forward, 2.5x that backward); the fused loss forward + backward against
   ``linear`` + ``cross_entropy`` (and Liger's / Cut-Cross-Entropy's when installed), time, TFLOP/s
   (6·N·H·V), GB/s of the hidden states, weight and their gradients, and peak memory above the inputs.
3. **Host synchronizations** of ring calls on one rank (P = 1, a gloo group of one), causal and with packed
   documents and padding: the synchronizing CUDA calls ``torch.cuda.set_sync_debug_mode`` reports per forward and
   backward (each one waits for the GPU's queue; ``burstc/ops/host_reads.py``: the target is one read-back of the
   mask data per step, none for a static mask). On CPU the calls run, uncounted.
4. **A training step** of a ~1B-parameter HF Llama config (Llama-3.2-1B's shapes) at 32K tokens on one device,
   ``burstc.compile(model)`` (the fused loss; no mesh), AdamW, bf16: seconds per step, tokens/s, peak memory and
   MFU (FLOPs counted as BurstEngine does: ``burstc.bench.end_to_end.step_flops``) against the device's
   measured bf16 matmul peak.

Exit status 1 when any kernel check fails.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from burstc.kernels.attention_blocks import (block_attention_backward, block_attention_forward,  # noqa: E402
                                             block_kernel, reference_block_backward, reference_block_forward)
from burstc.ops.lse_merge import attention_delta  # noqa: E402
from burstc.testing.oracle import max_relative_error, tolerance  # noqa: E402

# (batch, query heads, kv heads, query rows, key rows, head dim, causal): odd lengths, GQA, MQA, a head dim of 80,
# a non-square causal block (the ring's bottom-right pieces are flipped to top-left ones)
ATTENTION_SHAPES = [
    (1, 4, 4, 37, 37, 64, True),
    (2, 8, 2, 129, 257, 128, False),
    (1, 4, 1, 100, 60, 64, True),
    (1, 2, 2, 333, 333, 80, True),
    (3, 6, 3, 65, 191, 32, False),
]
TINY_ATTENTION_SHAPES = [(1, 4, 2, 37, 37, 16, True), (2, 4, 1, 29, 53, 16, False)]
# (tokens, hidden, vocab): odd sizes, about a tenth of the tokens ignored
LOSS_SHAPES = [(1000, 512, 32003), (4097, 2048, 50257)]
TINY_LOSS_SHAPES = [(77, 32, 301)]

# Llama-3.2-1B's shapes (1.24B parameters, tied embeddings)
LLAMA_1B = dict(hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32,
                num_key_value_heads=8, vocab_size=128256, tie_word_embeddings=True, rope_theta=500000.0)
LLAMA_TINY = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, vocab_size=512, tie_word_embeddings=True)

# nominal dense bf16 peaks, TFLOP/s (spec sheets), beside the measured matmul peak
NOMINAL_BF16_TFLOPS = {"H100": 989.0, "H200": 989.0, "A100": 312.0, "A800": 312.0, "L40S": 362.0, "L4": 121.0}


class Device:
    def __init__(self, name: str):
        self.device = torch.device(name)
        self.cuda = self.device.type == "cuda"

    def sync(self):
        if self.cuda:
            torch.cuda.synchronize(self.device)

    def reset_peak(self):
        if self.cuda:
            torch.cuda.synchronize(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
        return self.allocated()

    def allocated(self) -> int:
        return torch.cuda.memory_allocated(self.device) if self.cuda else 0

    def peak(self) -> int:
        return torch.cuda.max_memory_allocated(self.device) if self.cuda else 0

    def time(self, fn, repeats: int, warmup: int = 1) -> float:
        """Median seconds of ``fn()`` (CUDA events on a GPU)."""
        for _ in range(warmup):
            fn()
        times = []
        for _ in range(repeats):
            if self.cuda:
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                fn()
                end.record()
                end.synchronize()
                times.append(start.elapsed_time(end) / 1e3)
            else:
                t0 = time.perf_counter()
                fn()
                times.append(time.perf_counter() - t0)
        return statistics.median(times)

    def describe(self) -> str:
        if self.cuda:
            props = torch.cuda.get_device_properties(self.device)
            return f"{props.name}, {props.total_memory / 2**30:.0f} GiB, torch {torch.__version__}"
        return f"CPU ({os.cpu_count()} cores), torch {torch.__version__}"


def _dtype_name(dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _random(shape, dtype, device, generator, scale=1.0):
    return (torch.randn(shape, generator=generator, dtype=torch.float32) * scale).to(device=device, dtype=dtype)


# ---- 1. kernels against references ---------------------------------------------------------------------------


def _guarded(check, what: str, kernel: str, dtype, shape: str, run) -> dict:
    """``run()`` -> a check row; an exception (a kernel that does not launch here) is a failed row."""
    try:
        row = run()
    except Exception as exc:  # noqa: BLE001 - reported as this check's failure, the others still run
        row = {"check": what, "kernel": kernel, "dtype": _dtype_name(dtype), "shape": shape,
               "errors": {"raised": math.nan}, "worst": math.nan, "bound": math.nan, "ok": False,
               "error": f"{type(exc).__name__}: {str(exc)[:300]}"}
    check.append(row)
    _print_check(row)
    return row


def check_attention(dev: Device, shapes, dtypes, seed: int) -> list[dict]:
    rows = []
    g = torch.Generator().manual_seed(seed)
    for dtype in dtypes:
        tol = tolerance(dtype, "attention_block_grads")
        for batch, heads_q, heads_kv, q_rows, kv_rows, head_dim, causal in shapes:
            q = _random((batch, heads_q, q_rows, head_dim), dtype, dev.device, g)
            k = _random((batch, heads_kv, kv_rows, head_dim), dtype, dev.device, g)
            v = _random((batch, heads_kv, kv_rows, head_dim), dtype, dev.device, g)
            grad_out = _random((batch, heads_q, q_rows, head_dim), dtype, dev.device, g)
            kernel = block_kernel(q, k, v, causal)
            shape = f"B{batch} H{heads_q}/{heads_kv} {q_rows}x{kv_rows} D{head_dim}{' causal' if causal else ''}"

            def run(q=q, k=k, v=v, grad_out=grad_out, causal=causal, kernel=kernel, shape=shape):
                scale = q.shape[-1] ** -0.5
                out, lse = block_attention_forward(q, k, v, causal, scale)
                q64, k64, v64, do64 = (t.double() for t in (q, k, v, grad_out))
                ref_out, ref_lse = reference_block_forward(q64, k64, v64, causal, scale)
                delta = attention_delta(ref_out, do64)
                ref_grads = reference_block_backward(do64, q64, k64, v64, ref_lse, delta, causal, scale)
                # the ring's backward gets the global row statistics (here the block is the whole row) and, for a
                # query block from another rank, only delta: the stand-in output path
                grads = block_attention_backward(grad_out, q, k, v, ref_lse.float(), delta.float(), None, causal,
                                                 scale)
                errors = {"out": max_relative_error(out, ref_out), "lse": max_relative_error(lse, ref_lse)}
                errors.update({name: max_relative_error(got, want)
                               for name, got, want in zip(("dq", "dk", "dv"), grads, ref_grads)})
                worst = max(errors.values(), key=lambda e: math.inf if e != e else e)
                ok = all(e == e and e <= tol.rtol + tol.atol for e in errors.values())
                return {"check": "attention block", "kernel": kernel, "dtype": _dtype_name(dtype),
                        "shape": shape, "errors": errors, "worst": worst, "bound": tol.rtol + tol.atol, "ok": ok}

            _guarded(rows, "attention block", kernel, dtype, shape, run)
    return rows


def check_loss(dev: Device, shapes, dtypes, seed: int) -> list[dict]:
    from burstc.kernels.linear_cross_entropy import linear_cross_entropy_reference
    from burstc.ops.linear_cross_entropy import linear_cross_entropy

    rows = []
    g = torch.Generator().manual_seed(seed)
    impl = "triton" if dev.cuda else "torch (chunked)"
    for dtype in dtypes:
        loss_tol, grad_tol = tolerance(dtype, "loss").rtol, tolerance(dtype, "param_grad").rtol
        for tokens, hidden_size, vocab in shapes:
            hidden = _random((tokens, hidden_size), dtype, dev.device, g).requires_grad_()
            weight = _random((vocab, hidden_size), dtype, dev.device, g, scale=hidden_size ** -0.5).requires_grad_()
            target = torch.randint(0, vocab, (tokens,), generator=g).to(dev.device)
            target[torch.rand(tokens, generator=g).to(dev.device) < 0.1] = -100
            shape = f"N{tokens} H{hidden_size} V{vocab}"

            def run(hidden=hidden, weight=weight, target=target, shape=shape):
                loss = linear_cross_entropy(hidden, weight, target)
                loss.backward()
                h64, w64 = hidden.detach().double().requires_grad_(), weight.detach().double().requires_grad_()
                ref = linear_cross_entropy_reference(h64, w64, target, compute_dtype=torch.float64)
                ref.backward()
                errors = {"loss": max_relative_error(loss, ref),
                          "grad_hidden": max_relative_error(hidden.grad, h64.grad),
                          "grad_weight": max_relative_error(weight.grad, w64.grad)}
                ok = errors["loss"] <= loss_tol and max(errors["grad_hidden"], errors["grad_weight"]) <= grad_tol
                return {"check": "fused LM-head loss", "kernel": impl, "dtype": _dtype_name(dtype),
                        "shape": shape, "errors": errors, "worst": max(errors.values()),
                        "bound": max(loss_tol, grad_tol), "ok": bool(ok)}

            _guarded(rows, "fused LM-head loss", impl, dtype, shape, run)
    return rows


def _print_check(row):
    status = "ok  " if row["ok"] else "FAIL"
    errors = row.get("error") or " ".join(f"{k} {v:.1e}" for k, v in row["errors"].items())
    print(f"[{status}] {row['check']:<18} {row['kernel']:<16} {row['dtype']:<8} {row['shape']:<28} {errors}",
          flush=True)


# ---- 2. timings ----------------------------------------------------------------------------------------------


def time_attention(dev: Device, batch, heads, seq, head_dim, dtype, repeats) -> dict:
    g = torch.Generator().manual_seed(1)
    q, k, v, grad_out = (_random((batch, heads, seq, head_dim), dtype, dev.device, g) for _ in range(4))
    scale = head_dim ** -0.5
    forward_flops = 4 * batch * heads * seq * seq * head_dim / 2  # causal: half the score matrix
    total_flops = forward_flops * 3.5                              # backward = 2.5x forward (FlashAttention-2)

    def ring_block():
        out, lse = block_attention_forward(q, k, v, True, scale)
        block_attention_backward(grad_out, q, k, v, lse, None, out, True, scale)

    qr, kr, vr = (t.detach().clone().requires_grad_() for t in (q, k, v))

    def sdpa():
        qr.grad = kr.grad = vr.grad = None
        context = torch.nn.attention.sdpa_kernel(torch.nn.attention.SDPBackend.FLASH_ATTENTION) if dev.cuda \
            else contextlib.nullcontext()
        with context:
            out = F.scaled_dot_product_attention(qr, kr, vr, is_causal=True, scale=scale)
        out.backward(grad_out)

    result = {"shape": f"B{batch} H{heads} S{seq} D{head_dim} causal", "dtype": _dtype_name(dtype),
              "kernel": block_kernel(q, k, v, True)}
    for name, fn in (("burstc block kernels", ring_block), ("torch SDPA (flash)", sdpa)):
        base = dev.reset_peak()
        seconds = dev.time(fn, repeats)
        result[name] = {"ms": seconds * 1e3, "tflops": total_flops / seconds / 1e12,
                        "peak_mib": (dev.peak() - base) / 2**20}
    result["burstc / torch time"] = result["burstc block kernels"]["ms"] / result["torch SDPA (flash)"]["ms"]
    return result


def _loss_implementations(dev: Device):
    from burstc.ops.linear_cross_entropy import linear_cross_entropy

    impls = {"burstc fused loss": lambda h, w, t: linear_cross_entropy(h, w, t),
             "torch linear + cross_entropy": lambda h, w, t: F.cross_entropy((h @ w.T).float(), t)}
    try:  # Liger's fused linear cross-entropy, when installed
        from liger_kernel.transformers.fused_linear_cross_entropy import LigerFusedLinearCrossEntropyLoss

        liger = LigerFusedLinearCrossEntropyLoss()
        impls["Liger fused linear CE"] = lambda h, w, t: liger(w, h, t)
    except Exception:  # noqa: BLE001 - not installed (or not importable here): no row
        pass
    try:  # Cut Cross-Entropy, when installed
        from cut_cross_entropy import linear_cross_entropy as cce

        impls["Cut Cross-Entropy"] = lambda h, w, t: cce(h, w, t)
    except Exception:  # noqa: BLE001
        pass
    return impls


def time_loss(dev: Device, tokens, hidden_size, vocab, dtype, repeats) -> dict:
    g = torch.Generator().manual_seed(2)
    hidden = _random((tokens, hidden_size), dtype, dev.device, g).requires_grad_()
    weight = _random((vocab, hidden_size), dtype, dev.device, g, scale=hidden_size ** -0.5).requires_grad_()
    target = torch.randint(0, vocab, (tokens,), generator=g).to(dev.device)
    flops = 6 * tokens * hidden_size * vocab  # logits forward, then d(hidden) and d(weight)
    element = torch.finfo(dtype).bits // 8
    traffic = 2 * (tokens + vocab) * hidden_size * element  # inputs read, their gradients written
    result = {"shape": f"N{tokens} H{hidden_size} V{vocab}", "dtype": _dtype_name(dtype)}
    for name, fn in _loss_implementations(dev).items():
        def step():
            hidden.grad = weight.grad = None
            fn(hidden, weight, target).backward()
        try:
            step()
            base = dev.reset_peak()
            seconds = dev.time(step, repeats, warmup=0)
            result[name] = {"ms": seconds * 1e3, "tflops": flops / seconds / 1e12, "gbps": traffic / seconds / 1e9,
                            "peak_mib": (dev.peak() - base) / 2**20}
        except Exception as exc:  # noqa: BLE001 - e.g. out of memory for the materialized logits: say so
            result[name] = {"error": f"{type(exc).__name__}: {str(exc)[:200]}"}
        hidden.grad = weight.grad = None
    return result


def ring_host_syncs(dev: Device, tiny: bool) -> dict:
    """``{mask: {"forward": n, "backward": n}}``: synchronizing CUDA calls of one ring call on a one-rank group, after
    a warm-up call (the block geometry's caches filled); on CPU the calls run and ``n`` is None (nothing to count)."""
    import tempfile
    import warnings

    import torch.distributed as dist

    from burstc.attention_ir import Documents, KeyPadding, MaskSpec
    from burstc.ops import ring_attention as ra

    own_group = not dist.is_initialized()
    rendezvous_dir = tempfile.TemporaryDirectory() if own_group else None  # removed with its file at the end
    if own_group:
        dist.init_process_group("gloo", init_method=f"file://{rendezvous_dir.name}/rendezvous", rank=0, world_size=1)
    batch, heads, seq, head_dim = (2, 2, 64, 16) if tiny else (2, 8, 4096, 64)
    generator = torch.Generator().manual_seed(0)
    doc_ids = (torch.rand(batch, seq, generator=generator) < 8 / seq).long().cumsum(1).to(dev.device)
    key_valid = torch.ones(batch, seq, dtype=torch.bool)
    key_valid[0, seq - seq // 4:] = False
    key_valid = key_valid.to(dev.device)
    masks = {"causal": (MaskSpec.causal(), {}),
             "causal & documents & padding": (MaskSpec.causal() & Documents("doc_ids") & KeyPadding("mask"),
                                              {"doc_ids": doc_ids, "key_valid": key_valid})}
    found = {}
    try:
        for name, (mask, data) in masks.items():
            q, k, v = (torch.randn(batch, heads, seq, head_dim, device=dev.device, requires_grad=True)
                       for _ in range(3))
            counts = {}
            for call in range(2):
                for part in ("forward", "backward"):
                    with warnings.catch_warnings(record=True) as caught:
                        warnings.simplefilter("always")
                        if dev.cuda:
                            torch.cuda.set_sync_debug_mode("warn")
                        try:
                            if part == "forward":
                                out = ra.ring_attention(q, k, v, mask=mask, layout="zigzag", plan="burst", **data)
                            else:
                                out.float().square().sum().backward()
                        finally:
                            if dev.cuda:
                                torch.cuda.set_sync_debug_mode(0)
                    if dev.cuda:
                        torch.cuda.synchronize(dev.device)
                    counts[part] = sum("synchroniz" in str(w.message) for w in caught) if dev.cuda else None
            found[name] = counts
            print(f"ring host syncs, {name}: {counts}", flush=True)
    finally:
        if own_group:
            dist.destroy_process_group()
            rendezvous_dir.cleanup()
    return found


def measured_matmul_tflops(dev: Device, size: int, dtype) -> float:
    a, b = torch.randn(size, size, device=dev.device, dtype=dtype), torch.randn(size, size, device=dev.device,
                                                                                    dtype=dtype)
    seconds = dev.time(lambda: a @ b, repeats=5)
    return 2 * size ** 3 / seconds / 1e12


# ---- 3. a training step --------------------------------------------------------------------------------------


def train_step(dev: Device, config_kwargs: dict, seq_len: int, dtype, steps: int, peak_tflops: float | None
               ) -> dict:
    import transformers

    import burstc
    from burstc.bench.end_to_end import ModelShape, step_flops

    torch.manual_seed(0)
    config = transformers.LlamaConfig(**config_kwargs)
    with torch.device(dev.device):
        model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="sdpa",
                                                              dtype=dtype)
    model.train()
    params = sum(p.numel() for p in model.parameters())
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    compiled = burstc.compile(model)
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(0, config.vocab_size, (1, seq_len), generator=g).to(dev.device)

    def step():
        loss = compiled(input_ids=ids, labels=ids).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return loss

    t0 = time.perf_counter()
    first_loss = float(step().detach())  # compiles
    dev.sync()
    compile_s = time.perf_counter() - t0
    dev.reset_peak()
    seconds = dev.time(step, repeats=steps, warmup=0)
    shape = ModelShape(dim=config.hidden_size, layers=config.num_hidden_layers, heads=config.num_attention_heads,
                       kv_heads=config.num_key_value_heads, ffn=config.intermediate_size, vocab=config.vocab_size)
    flops = step_flops(shape, seq_len)
    report = burstc.report(compiled)
    return {"model": f"HF Llama {params / 1e9:.2f}B", "tokens": seq_len, "dtype": _dtype_name(dtype),
            "first step (compile) s": compile_s, "step s": seconds, "tokens/s": seq_len / seconds,
            "TFLOP/s": flops / seconds / 1e12,
            "MFU": flops / seconds / 1e12 / peak_tflops if peak_tflops else None,
            "peak GiB": dev.peak() / 2**30 if dev.cuda else None, "loss": first_loss,
            "rewrites": sorted({r.kind for r in report.rewrites})}


# ---- report --------------------------------------------------------------------------------------------------


def markdown(summary: dict) -> str:
    lines = [f"# burstc GPU check: {summary['device']}", ""]
    lines += ["## Kernels against fp64 references", "",
              "| check | kernel | dtype | shape | worst relative error | bound | result |", "|---|---|---|---|---|---|---|"]
    for row in summary["checks"]:
        lines.append(f"| {row['check']} | {row['kernel']} | {row['dtype']} | {row['shape']} | {row['worst']:.1e} | "
                     f"{row['bound']:.0e} | {'ok' if row['ok'] else '**FAIL**'} |")
    lines += ["", "## Timings", "", "| what | shape | dtype | implementation | ms | TFLOP/s | GB/s | peak MiB |",
              "|---|---|---|---|---|---|---|---|"]
    for timing in summary["timings"]:
        for name, numbers in timing["results"].items():
            if not isinstance(numbers, dict):
                continue
            if "error" in numbers:
                lines.append(f"| {timing['what']} | {timing['shape']} | {timing['dtype']} | {name} | "
                             f"{numbers['error']} | | | |")
                continue
            gbps = f"{numbers['gbps']:.0f}" if "gbps" in numbers else ""
            lines.append(f"| {timing['what']} | {timing['shape']} | {timing['dtype']} | {name} | {numbers['ms']:.2f} "
                         f"| {numbers['tflops']:.1f} | {gbps} | {numbers['peak_mib']:.0f} |")
    if summary.get("matmul_tflops"):
        lines += ["", f"Measured bf16 matmul peak: {summary['matmul_tflops']:.0f} TFLOP/s"
                      + (f" (nominal {summary['nominal_tflops']:.0f})" if summary.get("nominal_tflops") else "")]
    shown = lambda count: "–" if count is None else str(count)  # noqa: E731  (None: not counted, on CPU)
    lines += _section(summary.get("ring_host_syncs"), "Ring host synchronizations (one rank, after a warm-up call)",
                      lambda syncs: ["| mask | forward | backward |", "|---|---|---|"] + [
                          f"| {mask} | {shown(n['forward'])} | {shown(n['backward'])} |" for mask, n in syncs.items()])
    lines += _section(summary.get("train_step"), "Training step (one device)",
                      lambda step: ["| " + " | ".join(step) + " |", "|" + "---|" * len(step),
                                    "| " + " | ".join(_fmt(v) for v in step.values()) + " |"])
    return "\n".join(lines) + "\n"


def _section(entry: dict | None, title: str, table) -> list[str]:
    """A Markdown section for ``entry`` (absent: none; an ``error``: that; else ``table(entry)``'s lines)."""
    if not entry:
        return []
    return ["", f"## {title}", ""] + ([f"failed: {entry['error']}"] if "error" in entry else table(entry))


def _fmt(value) -> str:
    if isinstance(value, float):
        return f"{value:.3g}" if abs(value) < 1 else f"{value:,.1f}"
    return str(value)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--tiny", action="store_true", help="toy sizes (the CPU smoke run)")
    parser.add_argument("--out", type=Path, help="write gpu_check.json and gpu_check.md here")
    parser.add_argument("--seq-len", type=int, default=None, help="training-step tokens (default 32768; tiny 256)")
    parser.add_argument("--skip-train-step", action="store_true")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        print("no CUDA device: run with --device cpu --tiny for the smoke run", file=sys.stderr)
        return 2
    dev = Device(args.device)
    started = time.perf_counter()
    print(f"device: {dev.describe()}", flush=True)
    tiny = args.tiny
    dtypes = [torch.float32, torch.bfloat16]
    checks = check_attention(dev, TINY_ATTENTION_SHAPES if tiny else ATTENTION_SHAPES, dtypes, args.seed)
    checks += check_loss(dev, TINY_LOSS_SHAPES if tiny else LOSS_SHAPES, dtypes, args.seed)

    repeats = 2 if tiny else 5
    timings = []
    attention_shape = (1, 4, 256, 16) if tiny else (1, 32, 8192, 128)
    attention_dtype = torch.float32 if not dev.cuda else torch.bfloat16
    result = time_attention(dev, *attention_shape, attention_dtype, repeats)
    timings.append({"what": "attention fwd+bwd", "shape": result["shape"], "dtype": result["dtype"],
                    "results": result})
    print(f"attention {result['shape']} {result['dtype']} ({result['kernel']}): burstc "
          f"{result['burstc block kernels']['ms']:.2f} ms, torch SDPA {result['torch SDPA (flash)']['ms']:.2f} ms "
          f"({result['burstc / torch time']:.2f}x)", flush=True)
    # 16K tokens: torch's materialized logits (bf16, their fp32 copy, their gradient) still fit an 80 GB GPU
    loss_shape = (256, 32, 1000) if tiny else (16384, 2048, 128256)
    result = time_loss(dev, *loss_shape, attention_dtype, repeats)
    timings.append({"what": "LM head + CE fwd+bwd", "shape": result["shape"], "dtype": result["dtype"],
                    "results": result})
    print("loss " + ", ".join(f"{k}: {v['ms']:.1f} ms" for k, v in result.items()
                              if isinstance(v, dict) and "ms" in v), flush=True)

    summary = {"device": dev.describe(), "checks": checks, "timings": timings}
    try:
        summary["ring_host_syncs"] = ring_host_syncs(dev, tiny)
    except Exception as exc:  # noqa: BLE001 - reported, not fatal: the kernel checks above still count
        summary["ring_host_syncs"] = {"error": f"{type(exc).__name__}: {str(exc)[:300]}"}
        print(f"ring host syncs: {summary['ring_host_syncs']}", flush=True)
    peak = None
    if dev.cuda:
        summary["matmul_tflops"] = peak = measured_matmul_tflops(dev, 8192, torch.bfloat16)
        name = torch.cuda.get_device_name(dev.device)
        summary["nominal_tflops"] = next((v for k, v in NOMINAL_BF16_TFLOPS.items() if k in name), None)
    if not args.skip_train_step:
        seq_len = args.seq_len or (256 if tiny else 32768)
        try:
            summary["train_step"] = train_step(dev, LLAMA_TINY if tiny else LLAMA_1B, seq_len,
                                               torch.float32 if not dev.cuda else torch.bfloat16, steps=2,
                                               peak_tflops=peak)
        except Exception as exc:  # noqa: BLE001 - e.g. out of memory on a small GPU: reported, not fatal
            summary["train_step"] = {"error": f"{type(exc).__name__}: {str(exc)[:300]}"}
        print(f"training step: {summary['train_step']}", flush=True)
    summary["seconds"] = time.perf_counter() - started
    text = markdown(summary)
    print(text)
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "gpu_check.json").write_text(json.dumps(summary, indent=1, default=str))
        (args.out / "gpu_check.md").write_text(text)
    failed = [row for row in checks if not row["ok"]]
    print(f"{len(checks) - len(failed)} of {len(checks)} kernel checks passed in {summary['seconds']:.0f} s")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
