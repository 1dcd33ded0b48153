"""What a sliding window's band costs on ATen's CPU flash kernel, per visible score entry, against dense causal's
(issue 16's target: a window's step time within 10% of its work fraction of causal's).

A band of width ``w`` over tiles of ``T`` rows is, per tile, a full block (the keys every row sees) and two
``T x T`` triangles (the band's ragged edges: a causal one and an anti-causal one, run by the causal kernel on
reversed rows).  ATen's kernel skips masked key blocks only at its own split sizes (256 query rows x 512 keys for
long inputs), so a triangle costs most of its square; smaller tiles shrink the triangles but run thin, less
efficient calls.  The table gives each decomposition's fwd + bwd nanoseconds per visible entry and per head, over
dense causal's: the floor any tiling reaches on this kernel.

    python benchmarks/window_kernel_floor.py [--window 2048] [--seq-len 8192]
"""
import argparse
import time

import torch

FLASH = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
FLASH_BACKWARD = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward
HEADS, HEAD_DIM, SCALE = 4, 64, 0.125


def _seconds(rows: int, keys: int, causal: bool, repeats: int = 3) -> float:
    """Best fwd + bwd seconds of one flash call on ``[1, HEADS, rows | keys, HEAD_DIM]``."""
    q, grad_out = torch.randn(1, HEADS, rows, HEAD_DIM), torch.randn(1, HEADS, rows, HEAD_DIM)
    k, v = torch.randn(1, HEADS, keys, HEAD_DIM), torch.randn(1, HEADS, keys, HEAD_DIM)
    best = float("inf")
    for _ in range(repeats):
        started = time.perf_counter()
        out, lse = FLASH(q, k, v, 0.0, causal, scale=SCALE)
        FLASH_BACKWARD(grad_out, q, k, v, out, lse, 0.0, causal, scale=SCALE)
        best = min(best, time.perf_counter() - started)
    return best


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--window", type=int, default=2048)
    parser.add_argument("--seq-len", type=int, default=8192, help="dense causal's length (its ns/entry)")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    w, seq_len = args.window, args.seq_len
    causal_ns = _seconds(seq_len, seq_len, True) / (seq_len * (seq_len + 1) / 2) / HEADS * 1e9
    print(f"dense causal S={seq_len}: {causal_ns:.2f} ns per visible entry per head (fwd + bwd)\n")
    print("| tile rows T | full block | triangles | ns / visible entry | over causal's |")
    print("|---|---|---|---|---|")
    for tile in (w // 16, w // 8, w // 4, w // 2, w):
        full = _seconds(tile, w - tile + 1, False) if tile < w else 0.0
        triangle = _seconds(tile, tile, True)
        ns = (full + 2 * triangle) / (tile * w) / HEADS * 1e9
        print(f"| {tile} | {tile} x {w - tile + 1} | 2 x {tile} | {ns:.2f} | {ns / causal_ns:.3f} |", flush=True)


if __name__ == "__main__":
    main()
