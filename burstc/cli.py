"""``burstc`` command line: ``burstc demo`` trains a small causal LM with burstc.compile."""
from __future__ import annotations

import argparse
import sys
import time


def peak_rss_bytes() -> int:
    """Peak resident memory of this process (VmHWM), in bytes; 0 where /proc is missing."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def _build_model(args):
    import torch

    torch.manual_seed(args.seed)
    if args.model == "hf-llama":
        from transformers import LlamaConfig, LlamaForCausalLM

        config = LlamaConfig(vocab_size=args.vocab, hidden_size=args.dim, intermediate_size=4 * args.dim,
                             num_hidden_layers=args.layers, num_attention_heads=args.heads,
                             num_key_value_heads=args.kv_heads, max_position_embeddings=args.seq_len)
        model = LlamaForCausalLM(config)

        def loss_of(m, ids):
            return m(input_ids=ids, labels=ids, use_cache=False).loss
        return model, loss_of

    from burstc.models import TitanLlama, TitanLlamaArgs, WithLoss

    model = WithLoss(TitanLlama(TitanLlamaArgs(dim=args.dim, n_layers=args.layers, n_heads=args.heads,
                                               n_kv_heads=args.kv_heads, vocab_size=args.vocab,
                                               max_seq_len=args.seq_len)))

    def loss_of(m, ids):
        return m(ids[:, :-1], ids[:, 1:])
    return model, loss_of


def demo(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="burstc demo", description=(
        "Train a small random-init causal LM on synthetic long sequences with burstc.compile and print "
        "loss (next to single-device eager at step 0), tokens/s, peak memory and burstc's report."))
    parser.add_argument("--model", choices=["titan-llama", "hf-llama"], default="titan-llama")
    parser.add_argument("--seq-len", type=int, default=4096)
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--dim", type=int, default=128)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--kv-heads", type=int, default=2)
    parser.add_argument("--vocab", type=int, default=16384)
    parser.add_argument("--backend", choices=["inductor", "aot_eager"], default="inductor")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")
    args = parser.parse_args(argv)

    import torch
    from tqdm import tqdm

    import burstc

    model, loss_of = _build_model(args)
    seq = args.seq_len + (1 if args.model == "titan-llama" else 0)
    gen = torch.Generator().manual_seed(args.seed)
    batches = [torch.randint(0, args.vocab, (args.batch, seq), generator=gen) for _ in range(args.steps)]

    with torch.no_grad():
        eager_loss0 = loss_of(model, batches[0]).item()

    cmodel = burstc.compile(model, backend=args.backend)
    opt = torch.optim.SGD(model.parameters(), lr=1e-2)
    tokens_per_step = args.batch * args.seq_len
    rows = []
    bar = tqdm(range(args.steps), desc="burstc demo", disable=args.no_progress, file=sys.stderr)
    for step in bar:
        t0 = time.perf_counter()
        loss = loss_of(cmodel, batches[step])
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        dt = time.perf_counter() - t0
        rows.append((step, loss.item(), tokens_per_step / dt, dt))
        bar.set_postfix(loss=f"{loss.item():.4f}")

    print(f"model {args.model}: dim {args.dim}, {args.layers} layers, {args.heads} heads "
          f"({args.kv_heads} kv), vocab {args.vocab}; {args.batch} x {args.seq_len} tokens per step; "
          f"backend {args.backend}; 1 process")
    print(f"step 0 loss: burstc {rows[0][1]:.6f}  single-device eager {eager_loss0:.6f}  "
          f"(|diff| {abs(rows[0][1] - eager_loss0):.2e})")
    for step, loss_value, tps, dt in rows:
        note = "  (includes compilation)" if step == 0 else ""
        print(f"step {step}: loss {loss_value:.4f}  {tps:,.0f} tokens/s  {dt:.2f} s{note}")
    print(f"peak resident memory: {peak_rss_bytes() / 2**20:,.0f} MiB")
    print(burstc.report(cmodel))
    return 0


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] in ("-h", "--help"):
        print("usage: burstc demo [options]   (burstc demo --help for the options)")
        return 0 if argv else 2
    command, rest = argv[0], argv[1:]
    if command == "demo":
        return demo(rest)
    print(f"burstc: unknown command {command!r}; commands: demo", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())
