"""A nanoGPT-style GPT (learned positions, tied embeddings, MHA), written the way nanoGPT writes it.

``attention="sdpa"`` uses F.scaled_dot_product_attention(is_causal=True); ``attention="manual"`` the
explicit ``softmax(q @ k^T * scale + masked_fill(tril))) @ v`` nanoGPT falls back to.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F


@dataclass
class GPTConfig:
    block_size: int = 1024
    vocab_size: int = 512
    n_layer: int = 2
    n_head: int = 4
    n_embd: int = 64
    dropout: float = 0.0
    bias: bool = True
    attention: str = "sdpa"  # or "manual"


class CausalSelfAttention(nn.Module):
    def __init__(self, config: GPTConfig):
        super().__init__()
        assert config.n_embd % config.n_head == 0
        self.c_attn = nn.Linear(config.n_embd, 3 * config.n_embd, bias=config.bias)
        self.c_proj = nn.Linear(config.n_embd, config.n_embd, bias=config.bias)
        self.attn_dropout = nn.Dropout(config.dropout)
        self.resid_dropout = nn.Dropout(config.dropout)
        self.n_head = config.n_head
        self.n_embd = config.n_embd
        self.dropout = config.dropout
        self.flash = config.attention == "sdpa"
        if not self.flash:
            self.register_buffer("bias", torch.tril(torch.ones(config.block_size, config.block_size))
                                 .view(1, 1, config.block_size, config.block_size))

    def forward(self, x):
        B, T, C = x.size()
        q, k, v = self.c_attn(x).split(self.n_embd, dim=2)
        k = k.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
        q = q.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
        v = v.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
        if self.flash:
            y = F.scaled_dot_product_attention(q, k, v, attn_mask=None,
                                               dropout_p=self.dropout if self.training else 0, is_causal=True)
        else:
            att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(k.size(-1)))
            att = att.masked_fill(self.bias[:, :, :T, :T] == 0, float("-inf"))
            att = F.softmax(att, dim=-1)
            att = self.attn_dropout(att)
            y = att @ v
        y = y.transpose(1, 2).contiguous().view(B, T, C)
        return self.resid_dropout(self.c_proj(y))


class MLP(nn.Module):
    def __init__(self, config: GPTConfig):
        super().__init__()
        self.c_fc = nn.Linear(config.n_embd, 4 * config.n_embd, bias=config.bias)
        self.gelu = nn.GELU()
        self.c_proj = nn.Linear(4 * config.n_embd, config.n_embd, bias=config.bias)
        self.dropout = nn.Dropout(config.dropout)

    def forward(self, x):
        return self.dropout(self.c_proj(self.gelu(self.c_fc(x))))


class Block(nn.Module):
    def __init__(self, config: GPTConfig):
        super().__init__()
        self.ln_1 = nn.LayerNorm(config.n_embd, bias=config.bias)
        self.attn = CausalSelfAttention(config)
        self.ln_2 = nn.LayerNorm(config.n_embd, bias=config.bias)
        self.mlp = MLP(config)

    def forward(self, x):
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    def __init__(self, config: GPTConfig):
        super().__init__()
        self.config = config
        self.transformer = nn.ModuleDict(dict(
            wte=nn.Embedding(config.vocab_size, config.n_embd),
            wpe=nn.Embedding(config.block_size, config.n_embd),
            drop=nn.Dropout(config.dropout),
            h=nn.ModuleList([Block(config) for _ in range(config.n_layer)]),
            ln_f=nn.LayerNorm(config.n_embd, bias=config.bias),
        ))
        self.lm_head = nn.Linear(config.n_embd, config.vocab_size, bias=False)
        self.transformer.wte.weight = self.lm_head.weight  # weight tying
        self.apply(self._init_weights)

    def _init_weights(self, module):
        if isinstance(module, nn.Linear):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)
            if module.bias is not None:
                nn.init.zeros_(module.bias)
        elif isinstance(module, nn.Embedding):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)

    def trunk(self, idx):
        b, t = idx.size()
        pos = torch.arange(0, t, dtype=torch.long, device=idx.device)
        tok_emb = self.transformer.wte(idx)
        pos_emb = self.transformer.wpe(pos)
        x = self.transformer.drop(tok_emb + pos_emb)
        for block in self.transformer.h:
            x = block(x)
        return self.transformer.ln_f(x)

    def forward(self, idx, targets=None):
        x = self.trunk(idx)
        if targets is not None:
            logits = self.lm_head(x)
            loss = F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1), ignore_index=-1)
        else:
            logits = self.lm_head(x[:, [-1], :])
            loss = None
        return logits, loss


class NextTokenGPT(GPT):
    """The loss as HF transformers 4.x and much training code write it: the logits of every position but the
    last against the labels shifted by one, inside the model (``labels`` may be the input ids themselves)."""

    def __init__(self, config: GPTConfig, reduction: str = "mean", label_smoothing: float = 0.0):
        super().__init__(config)
        self.reduction, self.label_smoothing = reduction, label_smoothing

    def forward(self, idx, labels):
        logits = self.lm_head(self.trunk(idx))
        shift_logits = logits[..., :-1, :].contiguous()
        shift_labels = labels[..., 1:].contiguous()
        return F.cross_entropy(shift_logits.view(-1, shift_logits.size(-1)), shift_labels.view(-1),
                               reduction=self.reduction, label_smoothing=self.label_smoothing)


class LossStyleGPT(GPT):
    """The loss spelled another way: ``"nll"``, ``nll_loss(log_softmax(logits))`` on flattened tokens;
    ``"classes_in_dim_1"``, cross-entropy on CE's sequence layout ``logits.transpose(1, 2)`` with ``[B, S]``
    targets (per-token losses ``[B, S]`` with ``reduction="none"``, summed here)."""

    def __init__(self, config: GPTConfig, style: str, reduction: str):
        super().__init__(config)
        self.style, self.reduction = style, reduction

    def forward(self, idx, targets):
        logits = self.lm_head(self.trunk(idx))
        if self.style == "nll":
            log_probs = F.log_softmax(logits, dim=-1)
            loss = F.nll_loss(log_probs.view(-1, log_probs.size(-1)), targets.view(-1), ignore_index=-1,
                              reduction=self.reduction)
        else:
            loss = F.cross_entropy(logits.transpose(1, 2), targets, ignore_index=-1, reduction=self.reduction)
        return loss.sum() if self.reduction == "none" else loss


# builders for multi-rank tests (module level: they are pickled to workers); each seeds itself

def nanogpt_sdpa():
    torch.manual_seed(0)
    return GPT(GPTConfig(block_size=64, vocab_size=97, n_layer=2, attention="sdpa"))


def nanogpt_manual():
    torch.manual_seed(0)
    return GPT(GPTConfig(block_size=64, vocab_size=97, n_layer=2, attention="manual"))


def nanogpt_inputs():
    g = torch.Generator().manual_seed(1)
    x, y = torch.randint(0, 97, (2, 32), generator=g), torch.randint(0, 97, (2, 32), generator=g)
    y[0, 3:9] = -1  # nanoGPT's ignore_index
    return x, y


def nanogpt_loss(model, inputs):
    return model(*inputs)[1]


def nanogpt_next_token(reduction: str = "mean", label_smoothing: float = 0.0):
    torch.manual_seed(0)
    return NextTokenGPT(GPTConfig(block_size=64, vocab_size=97, n_layer=2, attention="sdpa"), reduction,
                        label_smoothing)


def next_token_inputs(batch: int = 2, seq: int = 32):
    g = torch.Generator().manual_seed(2)
    ids = torch.randint(0, 97, (batch, seq), generator=g)
    labels = ids.clone()
    labels[0, 5:9] = -100  # some ignored (e.g. prompt tokens)
    return ids, labels


def next_token_loss(model, inputs):
    return model(*inputs)


def nanogpt_loss_style(style: str, reduction: str = "mean"):
    torch.manual_seed(0)
    return LossStyleGPT(GPTConfig(block_size=64, vocab_size=97, n_layer=2, attention="sdpa"), style, reduction)


def loss_style_loss(model, inputs):
    return model(*inputs)
