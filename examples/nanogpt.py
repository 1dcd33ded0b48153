"""Train the zoo's nanoGPT-style GPT (learned positions, tied embeddings, MHA; written the way nanoGPT writes
it: burstc.testing.zoo.nanogpt) for a few steps under ``burstc.compile``.

    python examples/nanogpt.py --steps 5 --seq-len 512

``--attention sdpa`` uses F.scaled_dot_product_attention(is_causal=True); ``--attention manual`` the
explicit ``softmax(q @ k^T * scale + masked_fill(tril))) @ v`` nanoGPT falls back to.
"""
from __future__ import annotations

import argparse
import time

import torch

from burstc.testing.zoo.nanogpt import GPT, GPTConfig


def main():
    import burstc

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--seq-len", type=int, default=512)
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--backend", default="inductor", choices=["inductor", "aot_eager"])
    parser.add_argument("--attention", default="sdpa", choices=["sdpa", "manual"])
    args = parser.parse_args()

    torch.manual_seed(0)
    model = GPT(GPTConfig(block_size=args.seq_len, attention=args.attention))
    cmodel = burstc.compile(model, backend=args.backend)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    data = torch.randint(0, model.config.vocab_size, (args.batch, args.seq_len + 1))
    x, y = data[:, :-1], data[:, 1:]
    for step in range(args.steps):
        t0 = time.perf_counter()
        logits, loss = cmodel(x, y)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        dt = time.perf_counter() - t0
        print(f"step {step}: loss {loss.item():.4f}, {args.batch * args.seq_len / dt:,.0f} tokens/s, "
              f"logits returned: {logits is not None}")
    print(burstc.report(cmodel))


if __name__ == "__main__":
    main()
