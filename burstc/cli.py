"""``burstc`` command line: ``burstc demo`` trains a small causal LM with burstc.compile; ``burstc explain`` shows
what burstc would do to a model on a cluster (:mod:`burstc.explain`); ``burstc bench`` runs the end-to-end
benchmark against the peers (:mod:`burstc.bench.end_to_end`)."""
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

    from burstc.testing.zoo.titan import TitanLlama, TitanLlamaArgs, WithLoss

    model = WithLoss(TitanLlama(TitanLlamaArgs(dim=args.dim, n_layers=args.layers, n_heads=args.heads,
                                               n_kv_heads=args.kv_heads, vocab_size=args.vocab,
                                               max_seq_len=args.seq_len)))

    def loss_of(m, ids):
        return m(ids[:, :-1], ids[:, 1:])
    return model, loss_of


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


def _check_shapes(parser: argparse.ArgumentParser, args) -> None:
    """The model's shape constraints, as argparse errors instead of tracebacks from deep inside the model."""
    if args.dim % args.heads:
        parser.error(f"--dim {args.dim} must be a multiple of --heads {args.heads} (the head dimension is dim / heads)")
    if (args.dim // args.heads) % 2:
        parser.error(f"--dim / --heads = {args.dim // args.heads} must be even (rotary embeddings rotate pairs)")
    if args.heads % args.kv_heads:
        parser.error(f"--heads {args.heads} must be a multiple of --kv-heads {args.kv_heads}")


def _parser():
    parser = argparse.ArgumentParser(prog="burstc demo", description=(
        "Train a small random-init causal LM on synthetic long sequences with burstc.compile, the sequence "
        "sharded over P gloo ranks (spawned here, or launched by torchrun), and print the loss of step 0 "
        "next to the single-device eager loss, tokens/s, peak memory and bytes sent per rank, and the report."))
    parser.add_argument("--ranks", type=_positive_int, default=2, help="sequence-parallel ranks (ignored under torchrun)")
    parser.add_argument("--model", choices=["titan-llama", "hf-llama"], default="titan-llama")
    parser.add_argument("--seq-len", type=_positive_int, default=16384)
    parser.add_argument("--batch", type=_positive_int, default=1)
    parser.add_argument("--steps", type=_positive_int, default=3)
    parser.add_argument("--dim", type=_positive_int, default=64)
    parser.add_argument("--layers", type=_positive_int, default=2)
    parser.add_argument("--heads", type=_positive_int, default=4)
    parser.add_argument("--kv-heads", type=_positive_int, default=2)
    parser.add_argument("--vocab", type=_positive_int, default=8192)
    parser.add_argument("--layout", choices=["auto", "contiguous", "zigzag", "striped"], default="auto")
    parser.add_argument("--backend", choices=["inductor", "aot_eager"], default="aot_eager")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--no-reference", action="store_true", help="skip the single-device eager loss")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")
    return parser


def _free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _demo_rank(rank: int, world_size: int, args, init_method: str | None):
    import os

    import torch
    import torch.distributed as dist
    from tqdm import tqdm

    import burstc
    from burstc.ops.ring_attention import record_stats

    torch.set_num_threads(max(1, (os.cpu_count() or 1) // world_size))
    if world_size > 1 and not dist.is_initialized():
        dist.init_process_group("gloo", init_method=init_method, rank=rank, world_size=world_size)
    model, loss_of = _build_model(args)
    seq = args.seq_len + (1 if args.model == "titan-llama" else 0)
    gen = torch.Generator().manual_seed(args.seed)
    batches = [torch.randint(0, args.vocab, (args.batch, seq), generator=gen) for _ in range(args.steps)]

    eager_loss0 = None
    if rank == 0 and not args.no_reference:
        with torch.no_grad():
            eager_loss0 = loss_of(model, batches[0]).item()

    mesh = None
    if world_size > 1:
        from torch.distributed.device_mesh import init_device_mesh

        mesh = init_device_mesh("cpu", (world_size,))
    cmodel = burstc.compile(model, mesh, backend=args.backend, layout=args.layout)
    opt = torch.optim.SGD(model.parameters(), lr=1e-2)
    tokens_per_step = args.batch * args.seq_len
    rows = []
    bar = tqdm(range(args.steps), desc="burstc demo", disable=args.no_progress or rank != 0, file=sys.stderr)
    with record_stats() as stats:
        for step in bar:
            t0 = time.perf_counter()
            loss = loss_of(cmodel, batches[step])
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            dt = time.perf_counter() - t0
            rows.append((step, loss.item(), tokens_per_step / dt, dt))
            bar.set_postfix(loss=f"{loss.item():.4f}")
    calls_per_step = max(1, len(stats.calls) // max(1, args.steps))
    sent_per_step = sum(c.total_bytes_sent for c in stats.calls[-calls_per_step:]) if stats.calls else 0
    per_rank = [(rank, peak_rss_bytes(), sent_per_step)]
    if world_size > 1:
        gathered = [None] * world_size
        dist.all_gather_object(gathered, per_rank[0])
        per_rank = gathered
    if rank == 0:
        print(f"model {args.model}: dim {args.dim}, {args.layers} layers, {args.heads} heads ({args.kv_heads} kv), "
              f"vocab {args.vocab}; {args.batch} x {args.seq_len} tokens per step on {world_size} rank(s) "
              f"({args.seq_len // world_size} per rank, layout {args.layout}); backend {args.backend}")
        if eager_loss0 is not None:
            print(f"step 0 loss: burstc {rows[0][1]:.6f}  single-device eager {eager_loss0:.6f}  "
                  f"(|diff| {abs(rows[0][1] - eager_loss0):.2e})")
        for step, loss_value, tps, dt in rows:
            note = "  (includes compilation)" if step == 0 else ""
            print(f"step {step}: loss {loss_value:.4f}  {tps:,.0f} tokens/s  {dt:.2f} s{note}")
        for r, rss, sent in per_rank:
            print(f"rank {r}: peak resident memory {rss / 2**20:,.0f} MiB, ring attention sent "
                  f"{sent / 2**20:,.2f} MiB per step")
        print(burstc.report(cmodel))
    if world_size > 1:
        dist.barrier()
        dist.destroy_process_group()


def demo(argv=None) -> int:
    import os

    parser = _parser()
    args = parser.parse_args(argv)
    _check_shapes(parser, args)
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:  # under torchrun
        import torch.distributed as dist

        dist.init_process_group("gloo")
        _demo_rank(dist.get_rank(), dist.get_world_size(), args, None)
        return 0
    if args.ranks <= 1:
        _demo_rank(0, 1, args, None)
        return 0
    import torch.multiprocessing as mp

    init_method = f"tcp://127.0.0.1:{_free_port()}"
    mp.start_processes(_demo_rank, args=(args.ranks, args, init_method), nprocs=args.ranks, join=True,
                       start_method="spawn")
    return 0


def bench(argv=None) -> int:
    """``burstc bench``: :mod:`burstc.bench.end_to_end`."""
    from burstc.bench.end_to_end import main as bench_main

    return bench_main(argv)


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] in ("-h", "--help"):
        print("usage: burstc demo [options]               train a small LM on P gloo ranks (burstc demo --help)\n"
              "       burstc explain MODULE:FACTORY [options]  burstc's plan for a model on a cluster, without one "
              "(burstc explain --help)\n"
              "       burstc bench [options]                   end-to-end training benchmark vs the peers "
              "(burstc bench --help)")
        return 0 if argv else 2
    command, rest = argv[0], argv[1:]
    if command == "demo":
        return demo(rest)
    if command == "explain":
        import importlib

        return importlib.import_module("burstc.explain").main(rest)
    if command == "bench":
        return bench(rest)
    print(f"burstc: unknown command {command!r}; commands: demo, explain, bench", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())
