"""Model, input and loss builders for multi-rank tests (module level: they are pickled to workers).

Every builder seeds itself, so each rank and the single-device reference build the same thing."""
import torch


def titan_llama():
    from burstc.models import TitanLlama, TitanLlamaArgs, WithLoss

    torch.manual_seed(0)
    return WithLoss(TitanLlama(TitanLlamaArgs(dim=32, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=97,
                                              max_seq_len=64)))


def titan_mha():
    from burstc.models import TitanLlama, TitanLlamaArgs, WithLoss

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


def nanogpt_sdpa():
    from nanogpt import GPT, GPTConfig

    torch.manual_seed(0)
    return GPT(GPTConfig(block_size=64, vocab_size=97, n_layer=2, attention="sdpa"))


def nanogpt_manual():
    from nanogpt import GPT, GPTConfig

    torch.manual_seed(0)
    return GPT(GPTConfig(block_size=64, vocab_size=97, n_layer=2, attention="manual"))


def nanogpt_inputs():
    g = torch.Generator().manual_seed(1)
    x, y = torch.randint(0, 97, (2, 32), generator=g), torch.randint(0, 97, (2, 32), generator=g)
    y[0, 3:9] = -1  # nanoGPT's ignore_index
    return x, y


def nanogpt_loss(model, inputs):
    return model(*inputs)[1]


def hf_llama():
    import transformers

    torch.manual_seed(0)
    config = transformers.LlamaConfig(vocab_size=97, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    return transformers.LlamaForCausalLM(config)


def hf_inputs():
    g = torch.Generator().manual_seed(1)
    return torch.randint(0, 97, (2, 32), generator=g)


def hf_loss_no_cache(model, ids):
    return model(input_ids=ids, labels=ids, use_cache=False).loss


def hf_loss_default(model, ids):
    return model(input_ids=ids, labels=ids).loss


class MeanPooled(torch.nn.Module):
    """Mixes positions outside attention (mean over the sequence): the shard pass must refuse."""

    def __init__(self):
        super().__init__()
        self.emb = torch.nn.Embedding(97, 16)
        self.head = torch.nn.Linear(16, 97)

    def forward(self, ids, labels):
        h = self.emb(ids)
        h = h + h.mean(dim=1, keepdim=True)
        logits = self.head(h)
        return torch.nn.functional.cross_entropy(logits.view(-1, 97), labels.view(-1))


def mean_pooled():
    torch.manual_seed(0)
    return MeanPooled()


class Bidirectional(torch.nn.Module):
    """Non-causal SDPA: padding the sequence would change the real tokens' outputs."""

    def __init__(self):
        super().__init__()
        self.emb = torch.nn.Embedding(97, 16)
        self.qkv = torch.nn.Linear(16, 48)
        self.head = torch.nn.Linear(16, 97)

    def forward(self, ids, labels):
        h = self.emb(ids)
        q, k, v = self.qkv(h).view(*ids.shape, 3, 2, 8).permute(2, 0, 3, 1, 4)
        a = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=False)
        h = h + a.transpose(1, 2).reshape(*ids.shape, 16)
        logits = self.head(h)
        return torch.nn.functional.cross_entropy(logits.view(-1, 97), labels.view(-1))


def bidirectional():
    torch.manual_seed(0)
    return Bidirectional()


_HF_TINY = dict(vocab_size=97, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, max_position_embeddings=64, head_dim=8, n_embd=32, n_layer=2, n_head=4,
                n_positions=64, ffn_dim=64, word_embed_proj_dim=32, moe_intermediate_size=32, num_experts=4,
                num_local_experts=4, num_experts_per_tok=2, shared_expert_intermediate_size=32, rotary_dim=4,
                pad_token_id=0, logits_scaling=8.0)  # Granite divides its logits by it (default 1)
_HF_SPECIAL = {
    "GPTNeoXConfig": dict(vocab_size=97, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                          num_attention_heads=4, max_position_embeddings=64, pad_token_id=0),
    "FalconConfig": dict(vocab_size=97, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                         num_kv_heads=2, new_decoder_architecture=True, pad_token_id=0),
}


def hf_arch(config_name: str):
    """A tiny random-init HF causal LM of the given architecture (eval mode, dropout off): the config's
    own defaults with the tiny sizes above wherever its constructor takes them."""
    import inspect

    import transformers

    torch.manual_seed(0)
    cls = getattr(transformers, config_name)
    params = inspect.signature(cls.__init__).parameters
    kw = _HF_SPECIAL.get(config_name) or {k: v for k, v in _HF_TINY.items() if k in params}
    config = cls(**kw)
    for attr in ("attention_dropout", "hidden_dropout", "resid_pdrop", "embd_pdrop", "attn_pdrop"):
        if hasattr(config, attr):
            setattr(config, attr, 0.0)
    impl = "eager" if config_name == "Gemma2Config" else "sdpa"   # Gemma-2 has no SDPA path
    return transformers.AutoModelForCausalLM.from_config(config, attn_implementation=impl).eval()


def hf_arch_checkpointed(config_name: str):
    """hf_arch with HF's gradient checkpointing on, in training mode (where HF checkpoints; dropout is off)."""
    model = hf_arch(config_name)
    model.gradient_checkpointing_enable()
    return model.train()


def hf_arch_inputs():
    g = torch.Generator().manual_seed(1)
    return torch.randint(0, 97, (1, 32), generator=g)


def hf_arch_batch_inputs():
    g = torch.Generator().manual_seed(1)
    return torch.randint(1, 97, (2, 32), generator=g)


class Regularized(torch.nn.Module):
    """A loss plus a replicated parameter term: the shard pass must refuse (not count it P times)."""

    def __init__(self):
        super().__init__()
        from burstc.models import TitanLlama, TitanLlamaArgs, WithLoss

        torch.manual_seed(0)
        self.inner = WithLoss(TitanLlama(TitanLlamaArgs(dim=32, n_layers=1, n_heads=4, n_kv_heads=2,
                                                        vocab_size=97, max_seq_len=64)))

    def forward(self, tokens, labels):
        return self.inner(tokens, labels) + 0.01 * self.inner.model.output.weight.pow(2).sum()


def regularized():
    return Regularized()


def hf_inputs_single_sequence():
    g = torch.Generator().manual_seed(3)
    return torch.randint(0, 97, (1, 32), generator=g)


class WeightedPerTokenLoss(torch.nn.Module):
    """A loss built from ``reduction='none'`` per-token losses (position weights, masked mean), as
    custom training losses do: the shard pass must gather the per-token losses, not refuse."""

    def __init__(self):
        super().__init__()
        from burstc.models import TitanLlama, TitanLlamaArgs

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


class _InPlaceBase(torch.nn.Module):
    """Embedding + causal self-attention + LM head, with hooks for in-place ops that Dynamo records
    with unused results (what the passes must neither drop nor read around)."""
    variant = ""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.emb = torch.nn.Embedding(97, 16)
        self.pos = torch.nn.Embedding(64, 16)
        self.qkv = torch.nn.Linear(16, 48)
        self.router = torch.nn.Linear(16, 4)
        self.head = torch.nn.Linear(16, 97, bias=False)

    def forward(self, ids, labels):
        seq = ids.shape[1]
        positions = torch.arange(seq)
        if self.variant == "positions":
            positions.add_(1)  # written after it is made: a shard of the old value would be wrong
        h = self.emb(ids) + self.pos(positions)
        q, k, v = self.qkv(h).view(*ids.shape, 3, 2, 8).permute(2, 0, 3, 1, 4)
        if self.variant == "mask":
            mask = torch.ones(seq, seq, dtype=torch.bool).tril()
            mask[seq // 2:, : seq // 4] = False  # no longer causal: must not be folded as if it were
            a = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        else:
            a = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        h = h + a.transpose(1, 2).reshape(*ids.shape, 16)
        if self.variant == "scatter":
            # an MoE-style top-1 gate built with scatter_ (its result unused, as in Glm4Moe's router)
            scores = self.router(h).sigmoid()
            gate = torch.zeros_like(scores)
            gate.scatter_(-1, scores.argmax(-1, keepdim=True), 1.0)
            h = h * (scores * gate).sum(-1, keepdim=True)
        logits = self.head(h)
        if self.variant == "logits":
            logits.mul_(0.5)  # a temperature applied in place: the fused loss must not drop it
        return torch.nn.functional.cross_entropy(logits.view(-1, 97), labels.view(-1))


class InPlaceScatter(_InPlaceBase):
    variant = "scatter"


class InPlaceLogits(_InPlaceBase):
    variant = "logits"


class InPlaceMask(_InPlaceBase):
    variant = "mask"


class InPlacePositions(_InPlaceBase):
    variant = "positions"


class PositionwiseMinMax(torch.nn.Module):
    """``ones_like``, binary ``torch.max``/``minimum``, ``max(dim=-1)`` and ``min(dim=-1)`` on the hidden
    states (as in xIELU-style activations and MoE routers): position-wise, so shardable."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.emb = torch.nn.Embedding(97, 16)
        self.qkv = torch.nn.Linear(16, 48)
        self.head = torch.nn.Linear(16, 97, bias=False)

    def forward(self, ids, labels):
        h = self.emb(ids)
        h = torch.max(h, torch.ones_like(h) * -0.5) + torch.min(h, dim=-1, keepdim=True)[0]
        h = h - h.max(-1).values.unsqueeze(-1) * 0.1
        q, k, v = self.qkv(h).view(*ids.shape, 3, 2, 8).permute(2, 0, 3, 1, 4)
        a = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        h = h + a.transpose(1, 2).reshape(*ids.shape, 16)
        return torch.nn.functional.cross_entropy(self.head(h).view(-1, 97), labels.view(-1))


def hf_loss_with_attention_mask(model, ids):
    """As HF's Trainer calls a model on an unpadded batch: the tokenizer's all-ones attention_mask."""
    return model(input_ids=ids, labels=ids, attention_mask=torch.ones_like(ids), use_cache=False).loss


def hf_loss_with_padding(model, ids):
    """A padded batch: the second sequence's last 12 tokens are padding."""
    mask = torch.ones_like(ids)
    mask[-1, -12:] = 0
    return model(input_ids=ids, labels=ids, attention_mask=mask, use_cache=False).loss


def windowed_hf_llama():
    """A Mistral (Llama with a sliding window) whose window (8) is shorter than the sequence."""
    import transformers

    torch.manual_seed(0)
    config = transformers.MistralConfig(vocab_size=97, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                                        sliding_window=8)
    return transformers.MistralForCausalLM(config).eval()


def hf_loss_autocast(model, ids):
    """Mixed precision as users write it: fp32 parameters, the forward under torch.autocast(bf16)."""
    with torch.autocast("cpu", dtype=torch.bfloat16):
        return model(input_ids=ids, labels=ids, use_cache=False).loss


def titan_loss_autocast(model, inputs):
    with torch.autocast("cpu", dtype=torch.bfloat16):
        return call_with_loss(model, inputs)


def hf_llama_checkpointed():
    """HF's activation checkpointing, as long-sequence training turns it on."""
    model = hf_llama()
    model.gradient_checkpointing_enable()
    return model.train()


def titan_llama_checkpointed():
    """torchtitan-style per-layer activation checkpointing (checkpoint_wrapper around each block)."""
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

    model = titan_llama()
    for name, layer in list(model.model.layers.items()):
        model.model.layers[name] = checkpoint_wrapper(layer)
    return model
