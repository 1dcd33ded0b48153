"""The fuzzer's models and inputs, built from plain frozen specs (picklable, ``repr`` evaluable, so a case can be
sent to gloo workers and written into a reproducer file).

- :class:`ModelSpec` -> :class:`GeneratedLM`: a small decoder-only LM written the ways user code writes one
  (SDPA ``is_causal`` or a mask, manual softmax with ``tril`` / ``-inf`` / ``finfo.min`` masks, GQA via
  ``repeat_kv`` / ``repeat_interleave`` / ``enable_gqa``, qkv bias, QK-norm, soft-capped scores, ALiBi, sliding
  windows, packed-document and key-padding masks; RoPE full / partial / complex ``freqs_cis``, learned or no
  positions; RMS / layer / no norm; MLPs; tied or untied head; scale / soft-cap / upcast between head and loss;
  mean / sum / smoothed / ``nll_loss(log_softmax)`` / per-token losses);
- :class:`HFSpec`: a tiny random-init Hugging Face architecture (``zoo.hf_arch_variant``) with config overrides;
- :class:`InputSpec` -> :func:`build_inputs`: batch, length, packed documents (``position_ids`` restarting at 0),
  left or right padding (``attention_mask``), ignored labels;
- :func:`build_model` / :func:`compute_loss`: what the oracle calls on every rank and on the eager reference.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

MAX_POSITIONS = 128
IGNORE = -100


@dataclass(frozen=True)
class ModelSpec:
    vocab: int = 61
    dim: int = 32
    layers: int = 1
    heads: int = 4
    kv_heads: int = 4
    head_dim: int = 8
    # "sdpa_causal" (is_causal=True), "sdpa_bool" (bool attn_mask), "sdpa_float" (additive attn_mask),
    # "manual" (softmax(q k^T s + mask) v written out), "flex" (FlexAttention with a create_block_mask mask_mod:
    # causal, & window, & document ids captured from the forward; score_mod: soft-cap or ALiBi)
    attention: str = "sdpa_causal"
    mask_source: str = "arange"       # "arange" (built per call), "buffer" (nanoGPT's tril buffer), "triu"
    mask_fill: str = "-inf"           # additive / masked_fill value: "-inf" or "finfo.min"
    masked_fill: bool = True          # manual: scores.masked_fill(~allowed, fill) (else scores + additive mask)
    softmax_fp32: bool = False        # manual: softmax(..., dtype=float32).to(q.dtype)
    gqa: str = "repeat_kv"            # kv_heads < heads: "repeat_kv", "repeat_interleave", "enable_gqa" (SDPA)
    qkv_bias: bool = False
    qk_norm: bool = False
    score_softcap: float | None = None  # manual only: tanh(s / c) * c
    alibi: bool = False
    window: int | None = None         # keys i - window < j <= i
    documents: bool = False           # document mask from restarting position_ids
    document_ids_input: bool = False  # flex: the document ids come as an input (torchtitan), not from the forward
    key_padding: bool = False         # hide keys where attention_mask == 0
    positions: str = "rope"           # "rope", "rope_partial", "rope_complex", "learned", "none"
    norm: str = "rms"                 # "rms", "layer", "none"
    # "swiglu", "gelu", "relu2", "none"; mixtures of 4 experts routed top-k per token: "moe_batched" (each slot its
    # expert's weights, bmm), "moe_sorted" (slots sorted by expert, gathered, un-permuted by a scatter of arange),
    # "moe_argsort" (the same, un-permuted by argsort)
    mlp: str = "swiglu"
    moe_top_k: int = 2
    tied: bool = False
    head_bias: bool = False
    logits_op: str = "none"           # "none", "scale", "div", "softcap", "upcast", "scale_odd"
    loss: str = "ce_mean"             # see compute_generated_loss
    # a statistic over the whole sequence after the blocks (not causal; exactness is all that is checked): "none";
    # "sum_tokens" / "mean_tokens" (h + c * that over the sequence: every token sees it, its gradient comes from
    # every rank's tokens); "aux_mean" (loss + c * mean(h^2): a replicated loss term); "both" (one mean into the
    # tokens and the loss: refused); "max_tokens" (refused)
    sequence_term: str = "none"


@dataclass(frozen=True)
class HFSpec:
    config_name: str = "LlamaConfig"
    impl: str = "sdpa"                # attn_implementation
    overrides: tuple = ()             # (name, value) pairs passed to the config
    checkpointing: bool = False       # gradient_checkpointing_enable() + train()


@dataclass(frozen=True)
class InputSpec:
    batch: int = 1
    seq: int = 16
    documents: tuple = ()             # packed document lengths per row (the last one fills the row); () = none
    padding: str = "none"             # "none", "right", "left"
    pad_lengths: tuple = ()           # padded tokens per row
    ignore: str = "none"              # "none", "some", "all"
    seed: int = 0


# ---- the generated model ------------------------------------------------------------------------------------


def _rotate_half(x):
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


class FuzzAttention(nn.Module):
    def __init__(self, spec: ModelSpec):
        super().__init__()
        self.spec = spec
        h, hkv, d = spec.heads, spec.kv_heads, spec.head_dim
        self.q_proj = nn.Linear(spec.dim, h * d, bias=spec.qkv_bias)
        self.k_proj = nn.Linear(spec.dim, hkv * d, bias=spec.qkv_bias)
        self.v_proj = nn.Linear(spec.dim, hkv * d, bias=spec.qkv_bias)
        self.o_proj = nn.Linear(h * d, spec.dim, bias=False)
        if spec.qk_norm:
            self.q_norm, self.k_norm = nn.RMSNorm(d), nn.RMSNorm(d)
        if spec.mask_source == "buffer":
            tril = torch.tril(torch.ones(MAX_POSITIONS, MAX_POSITIONS, dtype=torch.bool))
            self.register_buffer("causal_mask", tril.view(1, 1, MAX_POSITIONS, MAX_POSITIONS), persistent=False)
        if spec.alibi:
            slopes = torch.tensor([2.0 ** (-8.0 * (i + 1) / h) for i in range(h)])
            self.register_buffer("alibi_slopes", slopes, persistent=False)

    def _allowed(self, seq, doc_ids, key_valid):
        """The bool [1 or B, 1, S, S] mask (True = attend), or None for plain causal via is_causal."""
        spec = self.spec
        if spec.mask_source == "buffer":
            allowed = self.causal_mask[:, :, :seq, :seq]
        elif spec.mask_source == "triu":
            allowed = ~torch.ones(seq, seq, dtype=torch.bool).triu(1)[None, None]
        else:
            i = torch.arange(seq)
            allowed = (i[:, None] >= i[None, :])[None, None]
        if spec.window is not None:
            i = torch.arange(seq)
            allowed = allowed & ((i[:, None] - i[None, :]) < spec.window)[None, None]
        if doc_ids is not None:
            allowed = allowed & (doc_ids[:, None, :, None] == doc_ids[:, None, None, :])
        if key_valid is not None:
            allowed = allowed & key_valid[:, None, None, :]
        return allowed

    def _fill(self, dtype):
        return float("-inf") if self.spec.mask_fill == "-inf" else torch.finfo(dtype).min

    def _bias(self, seq, dtype):
        i = torch.arange(seq)
        distance = (i[None, :] - i[:, None]).to(dtype)              # j - i, <= 0 where causal
        return self.alibi_slopes.to(dtype)[None, :, None, None] * distance[None, None]

    def _flex(self, q, k, v, doc_ids, enable_gqa):
        """FlexAttention with a block mask built per call (torchtitan's path); eager on CPU needs
        ``burstc.testing.zoo.flex.cpu_flex_backward`` around it (torch has no CPU FlexAttention backward)."""
        from torch.nn.attention.flex_attention import create_block_mask, flex_attention

        spec = self.spec
        window = spec.window

        def mask_mod(b, h, q_idx, kv_idx):
            allowed = q_idx >= kv_idx
            if window is not None:
                allowed = allowed & (q_idx - kv_idx < window)
            if doc_ids is not None:
                allowed = allowed & (doc_ids[b, q_idx] == doc_ids[b, kv_idx])
            return allowed

        score_mod = None
        if spec.score_softcap is not None:
            cap = spec.score_softcap

            def score_mod(score, b, h, q_idx, kv_idx):
                return cap * torch.tanh(score / cap)
        elif spec.alibi:
            slopes = self.alibi_slopes

            def score_mod(score, b, h, q_idx, kv_idx):
                return score + slopes[h] * (kv_idx - q_idx)
        batch, seq = q.shape[0], q.shape[2]
        block_mask = create_block_mask(mask_mod, batch if doc_ids is not None else None, None, seq, seq,
                                       device=q.device)
        return flex_attention(q, k, v, score_mod=score_mod, block_mask=block_mask, enable_gqa=enable_gqa)

    def forward(self, x, rope, doc_ids, key_valid):
        spec = self.spec
        b, s, _ = x.shape
        q = self.q_proj(x).view(b, s, spec.heads, spec.head_dim)
        k = self.k_proj(x).view(b, s, spec.kv_heads, spec.head_dim)
        v = self.v_proj(x).view(b, s, spec.kv_heads, spec.head_dim)
        if spec.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        if spec.positions == "rope_complex":
            q, k = _apply_complex_rope(q, rope), _apply_complex_rope(k, rope)
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
        if spec.positions in ("rope", "rope_partial"):
            cos, sin = rope
            rot = cos.shape[-1]
            q = torch.cat([q[..., :rot] * cos + _rotate_half(q[..., :rot]) * sin, q[..., rot:]], dim=-1)
            k = torch.cat([k[..., :rot] * cos + _rotate_half(k[..., :rot]) * sin, k[..., rot:]], dim=-1)
        enable_gqa = False
        if spec.kv_heads < spec.heads:
            rep = spec.heads // spec.kv_heads
            if spec.gqa == "repeat_kv":
                k = k[:, :, None].expand(b, spec.kv_heads, rep, s, spec.head_dim).reshape(b, spec.heads, s, -1)
                v = v[:, :, None].expand(b, spec.kv_heads, rep, s, spec.head_dim).reshape(b, spec.heads, s, -1)
            elif spec.gqa == "repeat_interleave":
                k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
            else:
                enable_gqa = True
        if spec.attention == "sdpa_causal":
            out = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=enable_gqa)
        elif spec.attention == "sdpa_bool":
            allowed = self._allowed(s, doc_ids, key_valid)
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=allowed, enable_gqa=enable_gqa)
        elif spec.attention == "sdpa_float":
            allowed = self._allowed(s, doc_ids, key_valid)
            additive = torch.zeros(allowed.shape, dtype=q.dtype).masked_fill(~allowed, self._fill(q.dtype))
            if spec.alibi:
                additive = additive + self._bias(s, q.dtype)
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=additive, enable_gqa=enable_gqa)
        elif spec.attention == "flex":
            out = self._flex(q, k, v, doc_ids, enable_gqa)
        else:
            scores = q @ k.transpose(-2, -1) * (1.0 / math.sqrt(spec.head_dim))
            if spec.score_softcap is not None:
                scores = torch.tanh(scores / spec.score_softcap) * spec.score_softcap
            if spec.alibi:
                scores = scores + self._bias(s, scores.dtype)
            allowed = self._allowed(s, doc_ids, key_valid)
            if spec.masked_fill:
                scores = scores.masked_fill(~allowed, self._fill(scores.dtype))
            else:
                scores = scores + torch.zeros(allowed.shape, dtype=scores.dtype).masked_fill(
                    ~allowed, self._fill(scores.dtype))
            if spec.softmax_fp32:
                probs = F.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)
            else:
                probs = F.softmax(scores, dim=-1)
            out = probs @ v
        return self.o_proj(out.transpose(1, 2).reshape(b, s, spec.heads * spec.head_dim))


def _apply_complex_rope(x_BSHD, freqs_cis_BSD2):
    x_complex = torch.view_as_complex(x_BSHD.float().reshape(*x_BSHD.shape[:-1], -1, 2))
    return torch.view_as_real(x_complex * freqs_cis_BSD2[:, :, None, :]).flatten(3).type_as(x_BSHD)


def _norm(kind, dim):
    return {"rms": lambda: nn.RMSNorm(dim), "layer": lambda: nn.LayerNorm(dim), "none": nn.Identity}[kind]()


class FuzzMLP(nn.Module):
    def __init__(self, spec: ModelSpec):
        super().__init__()
        self.kind = spec.mlp
        hidden = 2 * spec.dim
        self.up = nn.Linear(spec.dim, hidden, bias=spec.mlp != "swiglu")
        self.down = nn.Linear(hidden, spec.dim, bias=spec.mlp != "swiglu")
        if spec.mlp == "swiglu":
            self.gate = nn.Linear(spec.dim, hidden, bias=False)

    def forward(self, x):
        if self.kind == "swiglu":
            return self.down(F.silu(self.gate(x)) * self.up(x))
        if self.kind == "gelu":
            return self.down(F.gelu(self.up(x), approximate="tanh"))
        return self.down(F.relu(self.up(x)).square())


class FuzzMoE(nn.Module):
    """A dropless mixture of 4 SwiGLU-free experts (SiLU MLPs), top-k routing with renormalized weights."""
    EXPERTS = 4

    def __init__(self, spec: ModelSpec):
        super().__init__()
        self.kind, self.k, hidden = spec.mlp, spec.moe_top_k, 2 * spec.dim
        self.router = nn.Linear(spec.dim, self.EXPERTS, bias=False)
        self.up_EDF = nn.Parameter(torch.randn(self.EXPERTS, spec.dim, hidden) * spec.dim ** -0.5)
        self.down_EFD = nn.Parameter(torch.randn(self.EXPERTS, hidden, spec.dim) * hidden ** -0.5)

    def forward(self, x_BSD):
        x_TD = x_BSD.reshape(-1, x_BSD.shape[-1])
        weights_TK, experts_TK = torch.topk(F.softmax(self.router(x_TD), dim=-1, dtype=torch.float32), self.k, dim=-1)
        weights_TK = (weights_TK / weights_TK.sum(dim=-1, keepdim=True)).to(x_TD.dtype)
        experts_N, weights_N = experts_TK.reshape(-1), weights_TK.reshape(-1)  # N = T * k token slots
        if self.kind == "moe_batched":
            slots_ND = x_TD.repeat_interleave(self.k, dim=0)
        else:
            experts_N, perm_N = torch.sort(experts_N)
            slots_ND, weights_N = x_TD[perm_N // self.k], weights_N[perm_N]
        hidden_NF = F.silu(torch.bmm(slots_ND.unsqueeze(1), self.up_EDF[experts_N]).squeeze(1))
        out_ND = torch.bmm(hidden_NF.unsqueeze(1), self.down_EFD[experts_N]).squeeze(1) * weights_N.unsqueeze(-1)
        if self.kind == "moe_sorted":
            inverse_N = torch.empty_like(perm_N)
            inverse_N[perm_N] = torch.arange(perm_N.shape[0], device=perm_N.device)
            out_ND = out_ND[inverse_N]
        elif self.kind == "moe_argsort":
            out_ND = out_ND[perm_N.argsort()]
        return out_ND.view(x_TD.shape[0], self.k, -1).sum(dim=1).view(x_BSD.shape)


class FuzzBlock(nn.Module):
    def __init__(self, spec: ModelSpec):
        super().__init__()
        self.attn_norm = _norm(spec.norm, spec.dim)
        self.attn = FuzzAttention(spec)
        self.mlp = None if spec.mlp == "none" else FuzzMoE(spec) if spec.mlp.startswith("moe") else FuzzMLP(spec)
        self.mlp_norm = _norm(spec.norm, spec.dim)

    def forward(self, h, rope, doc_ids, key_valid):
        h = h + self.attn(self.attn_norm(h), rope, doc_ids, key_valid)
        if self.mlp is not None:
            h = h + self.mlp(self.mlp_norm(h))
        return h


class GeneratedLM(nn.Module):
    """``forward(input_ids, labels, position_ids=None, attention_mask=None) -> loss`` (called as HF models are), written from a :class:`ModelSpec`."""

    def __init__(self, spec: ModelSpec):
        super().__init__()
        self.spec = spec
        self.embed = nn.Embedding(spec.vocab, spec.dim)
        if spec.positions == "learned":
            self.pos_embed = nn.Embedding(MAX_POSITIONS, spec.dim)
        d = spec.head_dim
        if spec.positions in ("rope", "rope_partial"):
            rot = d if spec.positions == "rope" else max(2, (d // 2) // 2 * 2)
            self.register_buffer("inv_freq", 1.0 / (10000.0 ** (torch.arange(0, rot, 2).float() / rot)),
                                 persistent=False)
        if spec.positions == "rope_complex":
            freqs = 1.0 / (10000.0 ** (torch.arange(0, d, 2).float() / d))
            angles = torch.outer(torch.arange(MAX_POSITIONS).float(), freqs)
            self.register_buffer("freqs_cis", torch.polar(torch.ones_like(angles), angles), persistent=False)
        self.blocks = nn.ModuleList(FuzzBlock(spec) for _ in range(spec.layers))
        self.final_norm = _norm(spec.norm, spec.dim)
        if not spec.tied:
            self.lm_head = nn.Linear(spec.dim, spec.vocab, bias=spec.head_bias)
        elif spec.head_bias:
            self.head_bias = nn.Parameter(torch.zeros(spec.vocab).normal_(std=0.02))

    def forward(self, input_ids, labels, position_ids=None, attention_mask=None, use_cache=False, document_ids=None):
        spec, ids = self.spec, input_ids
        b, s = ids.shape
        positions = position_ids if position_ids is not None else torch.arange(s)[None].expand(b, s)
        doc_ids = (positions == 0).cumsum(-1) if spec.documents and position_ids is not None else None
        if document_ids is not None:
            doc_ids = document_ids
        key_valid = attention_mask.bool() if spec.key_padding and attention_mask is not None else None
        h = self.embed(ids)
        if spec.positions == "learned":
            h = h + self.pos_embed(positions)
        rope = None
        if spec.positions in ("rope", "rope_partial"):
            angles = positions[:, None, :, None].float() * self.inv_freq
            emb = torch.cat((angles, angles), dim=-1)
            rope = (emb.cos().to(h.dtype), emb.sin().to(h.dtype))
        elif spec.positions == "rope_complex":
            rope = self.freqs_cis[positions]
        for block in self.blocks:
            h = block(h, rope, doc_ids, key_valid)
        aux = None
        if spec.sequence_term in ("sum_tokens", "mean_tokens", "max_tokens", "both"):
            if spec.sequence_term == "sum_tokens":
                pooled = 0.05 * h.sum(dim=1, keepdim=True)
            elif spec.sequence_term == "max_tokens":
                pooled = h.amax(dim=1, keepdim=True)
            else:
                pooled = h.mean(dim=1, keepdim=True)
            h = h + pooled
            if spec.sequence_term == "both":
                aux = pooled.pow(2).sum()
        elif spec.sequence_term == "aux_mean":
            aux = h.float().pow(2).mean()
        h = self.final_norm(h)
        if spec.tied:
            logits = F.linear(h, self.embed.weight, self.head_bias if spec.head_bias else None)
        else:
            logits = self.lm_head(h)
        logits = _logits_op(spec.logits_op, logits)
        loss = compute_generated_loss(spec.loss, logits, labels)
        return loss if aux is None else loss + 0.01 * aux


def _logits_op(op, logits):
    if op == "scale":
        return logits * 0.5
    if op == "scale_odd":
        return logits / 3.0
    if op == "div":
        return logits / 4.0
    if op == "softcap":
        return torch.tanh(logits / 5.0) * 5.0
    if op == "upcast":
        return logits.float()
    return logits


LOSSES = ("ce_mean", "ce_sum", "ce_smooth", "nll", "ce_none_mean", "ce_shift", "ce_transpose")


def compute_generated_loss(kind, logits, labels):
    vocab = logits.shape[-1]
    if kind == "ce_sum":
        return F.cross_entropy(logits.view(-1, vocab), labels.view(-1), reduction="sum")
    if kind == "ce_smooth":
        return F.cross_entropy(logits.view(-1, vocab), labels.view(-1), label_smoothing=0.1)
    if kind == "nll":
        return F.nll_loss(F.log_softmax(logits.float(), dim=-1).view(-1, vocab), labels.view(-1))
    if kind == "ce_none_mean":
        per_token = F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten(0, 1), reduction="none")
        return per_token.sum() / (labels != IGNORE).sum().clamp(min=1)
    if kind == "ce_shift":  # HF style: predict the next token
        shifted = logits[:, :-1].contiguous()
        return F.cross_entropy(shifted.view(-1, vocab), labels[:, 1:].contiguous().view(-1))
    if kind == "ce_transpose":  # CE's [B, V, S] layout
        return F.cross_entropy(logits.transpose(1, 2), labels)
    return F.cross_entropy(logits.view(-1, vocab), labels.view(-1))


# ---- building a case's model, inputs and loss --------------------------------------------------------------


def build_model(spec, seed: int = 0):
    """The model of a :class:`ModelSpec` or :class:`HFSpec`, seeded (every rank and the reference agree)."""
    if isinstance(spec, HFSpec):
        from burstc.testing.zoo.hf import hf_arch_variant

        overrides = {k: list(v) if isinstance(v, tuple) else v for k, v in spec.overrides}  # HF wants lists
        model = hf_arch_variant(spec.config_name, spec.impl, **overrides)
        if spec.checkpointing:
            model.gradient_checkpointing_enable()
            model.train()
        return model
    torch.manual_seed(seed)
    model = GeneratedLM(spec)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() > 1:
                p.normal_(std=0.1)
    return model


def build_inputs(spec: InputSpec, vocab: int) -> dict:
    """``input_ids``, ``labels`` and, when the spec asks, ``position_ids`` (packed) / ``attention_mask`` (padded)."""
    g = torch.Generator().manual_seed(spec.seed)
    ids = torch.randint(1, vocab, (spec.batch, spec.seq), generator=g)
    labels = torch.randint(0, vocab, (spec.batch, spec.seq), generator=g)
    inputs = {"input_ids": ids}
    if spec.documents:
        from burstc.testing.zoo.hf import packed_position_ids

        position_ids = packed_position_ids(spec.batch, spec.seq, spec.documents)
        inputs["position_ids"] = position_ids
        labels = labels.masked_fill(position_ids == 0, IGNORE)  # no target across a document start
    if spec.padding != "none":
        mask = torch.ones(spec.batch, spec.seq, dtype=torch.long)
        for row, n in enumerate(spec.pad_lengths):
            if n:
                if spec.padding == "right":
                    mask[row, spec.seq - n:] = 0
                else:
                    mask[row, :n] = 0
        inputs["attention_mask"] = mask
        ids = ids.masked_fill(mask == 0, 0)
        inputs["input_ids"] = ids
        labels = labels.masked_fill(mask == 0, IGNORE)
    if spec.ignore == "some":
        labels = labels.masked_fill(torch.rand(labels.shape, generator=g) < 0.3, IGNORE)
    elif spec.ignore == "all":
        labels = torch.full_like(labels, IGNORE)
    inputs["labels"] = labels
    return inputs


def compute_loss(model, inputs: dict):
    """The loss of either kind of model on the inputs of :func:`build_inputs` (a generated model whose spec asks
    for ``document_ids_input`` also gets the document ids of its packed rows, as torchtitan passes them)."""
    spec = getattr(getattr(model, "_orig_mod", model), "spec", None)
    if getattr(spec, "document_ids_input", False) and "position_ids" in inputs:
        inputs = dict(inputs, document_ids=(inputs["position_ids"] == 0).cumsum(-1))
    out = model(**inputs, use_cache=False)
    return out if isinstance(out, torch.Tensor) else out.loss
