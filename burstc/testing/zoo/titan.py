"""The torchtitan-style Llama that ``burstc demo`` trains, and the test models and builders built on it.

``TitanLlama`` follows torchtitan's Llama: RoPE from a precomputed complex ``freqs_cis`` buffer,
GQA with ``repeat_kv``, RMSNorm, SwiGLU, untied output head; the loss is computed outside the model
as torchtitan's train loop does (:class:`WithLoss`).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F


@dataclass
class TitanLlamaArgs:
    dim: int = 128
    n_layers: int = 2
    n_heads: int = 4
    n_kv_heads: int | None = 2
    vocab_size: int = 1024
    multiple_of: int = 32
    norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    max_seq_len: int = 4096


def precompute_freqs_cis(dim: int, end: int, theta: float = 10000.0) -> torch.Tensor:
    freqs = 1.0 / (theta ** (torch.arange(0, dim, 2)[: (dim // 2)].float() / dim))
    t = torch.arange(end, device=freqs.device)
    freqs = torch.outer(t, freqs).float()
    return torch.polar(torch.ones_like(freqs), freqs)


def reshape_for_broadcast(freqs_cis: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    ndim = x.ndim
    seqlen = x.shape[1]
    freqs_cis = freqs_cis[0:seqlen]
    shape = [d if i == 1 or i == ndim - 1 else 1 for i, d in enumerate(x.shape)]
    return freqs_cis.view(*shape)


def apply_rotary_emb(xq, xk, freqs_cis):
    xq_ = torch.view_as_complex(xq.float().reshape(*xq.shape[:-1], -1, 2))
    xk_ = torch.view_as_complex(xk.float().reshape(*xk.shape[:-1], -1, 2))
    freqs_cis = reshape_for_broadcast(freqs_cis, xq_)
    xq_out = torch.view_as_real(xq_ * freqs_cis).flatten(3)
    xk_out = torch.view_as_real(xk_ * freqs_cis).flatten(3)
    return xq_out.type_as(xq), xk_out.type_as(xk)


def repeat_kv(x: torch.Tensor, n_rep: int) -> torch.Tensor:
    bs, slen, n_kv_heads, head_dim = x.shape
    if n_rep == 1:
        return x
    return (x[:, :, :, None, :].expand(bs, slen, n_kv_heads, n_rep, head_dim)
            .reshape(bs, slen, n_kv_heads * n_rep, head_dim))


class Attention(nn.Module):
    def __init__(self, args: TitanLlamaArgs):
        super().__init__()
        self.n_heads = args.n_heads
        self.n_kv_heads = args.n_heads if args.n_kv_heads is None else args.n_kv_heads
        self.n_rep = self.n_heads // self.n_kv_heads
        self.head_dim = args.dim // args.n_heads
        self.wq = nn.Linear(args.dim, args.n_heads * self.head_dim, bias=False)
        self.wk = nn.Linear(args.dim, self.n_kv_heads * self.head_dim, bias=False)
        self.wv = nn.Linear(args.dim, self.n_kv_heads * self.head_dim, bias=False)
        self.wo = nn.Linear(args.n_heads * self.head_dim, args.dim, bias=False)

    def forward(self, x, freqs_cis):
        bs, seqlen, _ = x.shape
        xq, xk, xv = self.wq(x), self.wk(x), self.wv(x)
        xq = xq.view(bs, seqlen, -1, self.head_dim)
        xk = xk.view(bs, seqlen, -1, self.head_dim)
        xv = xv.view(bs, seqlen, -1, self.head_dim)
        xq, xk = apply_rotary_emb(xq, xk, freqs_cis=freqs_cis)
        keys = repeat_kv(xk, self.n_rep)
        values = repeat_kv(xv, self.n_rep)
        xq, xk, xv = xq.transpose(1, 2), keys.transpose(1, 2), values.transpose(1, 2)
        output = F.scaled_dot_product_attention(xq, xk, xv, is_causal=True)
        output = output.transpose(1, 2).contiguous().view(bs, seqlen, -1)
        return self.wo(output)


class FeedForward(nn.Module):
    def __init__(self, dim: int, hidden_dim: int, multiple_of: int):
        super().__init__()
        hidden_dim = int(2 * hidden_dim / 3)
        hidden_dim = multiple_of * ((hidden_dim + multiple_of - 1) // multiple_of)
        self.w1 = nn.Linear(dim, hidden_dim, bias=False)
        self.w2 = nn.Linear(hidden_dim, dim, bias=False)
        self.w3 = nn.Linear(dim, hidden_dim, bias=False)

    def forward(self, x):
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class TransformerBlock(nn.Module):
    def __init__(self, args: TitanLlamaArgs):
        super().__init__()
        self.attention = Attention(args)
        self.feed_forward = FeedForward(args.dim, 4 * args.dim, args.multiple_of)
        self.attention_norm = nn.RMSNorm(args.dim, eps=args.norm_eps)
        self.ffn_norm = nn.RMSNorm(args.dim, eps=args.norm_eps)

    def forward(self, x, freqs_cis):
        h = x + self.attention(self.attention_norm(x), freqs_cis)
        return h + self.feed_forward(self.ffn_norm(h))


class TitanLlama(nn.Module):
    def __init__(self, args: TitanLlamaArgs):
        super().__init__()
        self.args = args
        self.tok_embeddings = nn.Embedding(args.vocab_size, args.dim)
        self.register_buffer("freqs_cis", precompute_freqs_cis(args.dim // args.n_heads, args.max_seq_len * 2,
                                                               args.rope_theta), persistent=False)
        self.layers = nn.ModuleDict({str(i): TransformerBlock(args) for i in range(args.n_layers)})
        self.norm = nn.RMSNorm(args.dim, eps=args.norm_eps)
        self.output = nn.Linear(args.dim, args.vocab_size, bias=False)
        for p in self.parameters():
            if p.dim() > 1:
                nn.init.normal_(p, std=0.02)

    def forward(self, tokens: torch.Tensor):
        h = self.tok_embeddings(tokens)
        for layer in self.layers.values():
            h = layer(h, self.freqs_cis)
        return self.output(self.norm(h))


class WithLoss(nn.Module):
    """torchtitan's train-loop loss around a model that returns logits."""

    def __init__(self, model: nn.Module):
        super().__init__()
        self.model = model

    def forward(self, tokens, labels):
        pred = self.model(tokens)
        return F.cross_entropy(pred.flatten(0, 1).float(), labels.flatten(0, 1))


# builders for multi-rank tests (module level: they are pickled to workers); each seeds itself

def titan_llama():
    torch.manual_seed(0)
    return WithLoss(TitanLlama(TitanLlamaArgs(dim=32, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=97,
                                              max_seq_len=64)))


def titan_mha():
    torch.manual_seed(0)
    return WithLoss(TitanLlama(TitanLlamaArgs(dim=32, n_layers=1, n_heads=4, n_kv_heads=4, vocab_size=97,
                                              max_seq_len=64)))


def titan_inputs():
    g = torch.Generator().manual_seed(1)
    return torch.randint(0, 97, (2, 32), generator=g), torch.randint(0, 97, (2, 32), generator=g)


def titan_inputs_odd_length():
    g = torch.Generator().manual_seed(1)
    return torch.randint(0, 97, (1, 30), generator=g), torch.randint(0, 97, (1, 30), generator=g)


def titan_inputs_odd_length_batch():
    g = torch.Generator().manual_seed(2)
    return torch.randint(0, 97, (3, 30), generator=g), torch.randint(0, 97, (3, 30), generator=g)


def call_with_loss(model, inputs):
    return model(*inputs)


def compiled_titan_step(mesh, **options):
    """One training step of ``titan_llama()`` (seed 0) compiled on ``mesh`` (``backend`` aot_eager unless given):
    ``(loss, {name: gradient}, burstc's report, the ring calls' stats)``."""
    import burstc
    from burstc.ops.ring_attention import record_stats

    torch._dynamo.reset()
    torch.manual_seed(0)
    model = titan_llama()
    cmodel = burstc.compile(model, mesh, backend=options.pop("backend", "aot_eager"), **options)
    with record_stats() as stats:
        loss = call_with_loss(cmodel, titan_inputs())
        loss.backward()
    grads = {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}
    return loss.detach(), grads, burstc.report(cmodel), stats


class Regularized(torch.nn.Module):
    """A loss plus a replicated parameter term: the shard pass must refuse (not count it P times)."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.inner = WithLoss(TitanLlama(TitanLlamaArgs(dim=32, n_layers=1, n_heads=4, n_kv_heads=2,
                                                        vocab_size=97, max_seq_len=64)))

    def forward(self, tokens, labels):
        return self.inner(tokens, labels) + 0.01 * self.inner.model.output.weight.pow(2).sum()


def regularized():
    return Regularized()


class WeightedPerTokenLoss(torch.nn.Module):
    """A loss built from ``reduction='none'`` per-token losses (position weights, masked mean), as
    custom training losses do: the shard pass must gather the per-token losses, not refuse."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.model = TitanLlama(TitanLlamaArgs(dim=32, n_layers=1, n_heads=4, n_kv_heads=2, vocab_size=97,
                                               max_seq_len=64))

    def forward(self, tokens, labels):
        logits = self.model(tokens)
        per_token = torch.nn.functional.cross_entropy(logits.flatten(0, 1).float(), labels.flatten(0, 1),
                                                      reduction="none")
        # later tokens weigh more; a replicated, gradient-free weight vector
        weights = torch.linspace(0.5, 1.5, per_token.shape[0])
        return (per_token * weights).sum() / weights.sum() + per_token.max()


def weighted_per_token_loss():
    return WeightedPerTokenLoss()


def single_sequence_inputs():
    g = torch.Generator().manual_seed(1)
    tokens, labels = torch.randint(0, 97, (1, 32), generator=g), torch.randint(0, 97, (1, 32), generator=g)
    labels[0, 5:11] = -100
    return tokens, labels


def titan_loss_autocast(model, inputs):
    with torch.autocast("cpu", dtype=torch.bfloat16):
        return call_with_loss(model, inputs)


def titan_llama_checkpointed():
    """torchtitan-style per-layer activation checkpointing (checkpoint_wrapper around each block)."""
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

    model = titan_llama()
    for name, layer in list(model.model.layers.items()):
        model.model.layers[name] = checkpoint_wrapper(layer)
    return model
