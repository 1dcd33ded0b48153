"""Train an unmodified HF ``LlamaForCausalLM`` (random init, synthetic data) with the sequence
sharded over every rank of the job:

    torchrun --nproc-per-node 2 examples/train_llama.py --seq-len 4096 --steps 3     # CPU, gloo
    torchrun --nproc-per-node 8 examples/train_llama.py --backend inductor           # GPUs, NCCL

Every rank gets the full batch; burstc.compile shards it.  The loss printed by rank 0 equals the
single-device loss.
"""
import argparse

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from transformers import LlamaConfig, LlamaForCausalLM

import burstc


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--seq-len", type=int, default=4096)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--backend", default="aot_eager", choices=["aot_eager", "inductor"])
    args = parser.parse_args()

    device = "cuda" if torch.cuda.is_available() else "cpu"
    dist.init_process_group("nccl" if device == "cuda" else "gloo")
    if device == "cuda":
        torch.cuda.set_device(dist.get_rank() % torch.cuda.device_count())
    mesh = init_device_mesh(device, (dist.get_world_size(),), mesh_dim_names=("cp",))

    torch.manual_seed(0)  # same weights on every rank
    config = LlamaConfig(vocab_size=8192, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=args.seq_len)
    model = LlamaForCausalLM(config).to(device)
    cmodel = burstc.compile(model, mesh, backend=args.backend)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)

    for step in range(args.steps):
        ids = torch.randint(0, config.vocab_size, (1, args.seq_len), generator=torch.Generator().manual_seed(step))
        out = cmodel(input_ids=ids.to(device), labels=ids.to(device), use_cache=False)
        out.loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        if dist.get_rank() == 0:
            print(f"step {step}: loss {out.loss.item():.4f}")
    if dist.get_rank() == 0:
        print(burstc.report(cmodel))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
