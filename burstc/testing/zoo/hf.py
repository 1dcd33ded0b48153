"""Tiny random-init Hugging Face causal LMs, their inputs and losses.

``transformers`` is imported inside the builders: a minimal install (no ``[test]`` extra) can still import
the zoo.  Every builder seeds itself, so each rank and the single-device reference build the same model."""
import torch


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


# The decoder architectures the sweep (benchmarks/mask_sweep.py) and the fuzzer (burstc.testing.fuzz) draw from.
HF_ARCHITECTURES = (
    "LlamaConfig", "MistralConfig", "Qwen2Config", "Qwen3Config", "GemmaConfig", "Gemma2Config", "Gemma3TextConfig",
    "Phi3Config", "PhiConfig", "GPTNeoXConfig", "StableLmConfig", "OlmoConfig", "Olmo2Config", "Olmo3Config",
    "OPTConfig", "FalconConfig", "GPT2Config", "Starcoder2Config", "GPTJConfig", "PersimmonConfig", "NemotronConfig",
    "ExaoneConfig", "Exaone4Config", "GlmConfig", "Glm4Config", "SmolLM3Config", "HeliumConfig", "ArceeConfig",
    "Ernie4_5Config", "SeedOssConfig", "CodeGenConfig", "BioGptConfig", "GPTBigCodeConfig", "HunYuanDenseV1Config",
    "ApertusConfig", "Lfm2Config", "DiffLlamaConfig", "BitNetConfig", "MinistralConfig", "Ministral3Config",
    "NanoChatConfig", "CohereConfig", "Cohere2Config", "GraniteConfig", "MixtralConfig", "Qwen2MoeConfig",
    "Qwen3MoeConfig", "OlmoeConfig", "GraniteMoeConfig", "MiniMaxConfig", "FlexOlmoConfig", "Glm4MoeConfig",
    "Llama4TextConfig", "FalconH1Config", "Qwen3NextConfig",
)

_HF_TINY = dict(vocab_size=97, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, max_position_embeddings=64, head_dim=8, n_embd=32, n_layer=2, n_head=4,
                n_positions=64, ffn_dim=64, word_embed_proj_dim=32, moe_intermediate_size=32, num_experts=4,
                num_local_experts=4, num_experts_per_tok=2, shared_expert_intermediate_size=32, rotary_dim=4,
                pad_token_id=0, logits_scaling=6.0)  # Granite divides its logits by it (default 1; 1 / 6 is inexact)
_DEEPSEEK_TINY = dict(vocab_size=97, hidden_size=32, intermediate_size=64, moe_intermediate_size=32,
                      num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4, n_routed_experts=4,
                      num_experts_per_tok=2, n_group=1, topk_group=1, n_shared_experts=1, kv_lora_rank=16,
                      q_lora_rank=16, qk_rope_head_dim=4, qk_nope_head_dim=8, v_head_dim=8, first_k_dense_replace=1,
                      max_position_embeddings=64, pad_token_id=0)  # multi-head latent attention: q/k 12, v 8 wide
_HF_SPECIAL = {
    "DeepseekV2Config": _DEEPSEEK_TINY, "DeepseekV3Config": _DEEPSEEK_TINY,
    "GPTNeoXConfig": dict(vocab_size=97, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                          num_attention_heads=4, max_position_embeddings=64, pad_token_id=0),
    "FalconConfig": dict(vocab_size=97, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                         num_kv_heads=2, new_decoder_architecture=True, pad_token_id=0),
    # ALiBi models with their own eager attention (no SDPA path in HF)
    "MptConfig": dict(vocab_size=97, d_model=32, n_heads=4, n_layers=2, max_seq_len=64, expansion_ratio=2,
                      pad_token_id=0),
    "BloomConfig": dict(vocab_size=97, hidden_size=32, n_head=4, n_layer=2, pad_token_id=0),
}


def hf_arch(config_name: str):
    """A tiny random-init HF causal LM of the given architecture (eval mode, dropout off): the config's
    own defaults with the tiny sizes above wherever its constructor takes them."""
    return hf_arch_variant(config_name, _attn_implementation(config_name))


def hf_arch_fewest_layers(config_name: str):
    """hf_arch with one decoder layer where its two layers are of one kind, else the two.

    Tracing and partitioning cost grows with the layers (2.8 s of an architecture's 2-rank check with two);
    a second layer identical to the first (same module types, parameter shapes and settings, only its index
    differs) adds no new attention, mask or MLP to rewrite.  Layers of different kinds (sliding and global
    attention, dense and MoE MLPs, Mamba and attention) keep both; so does a config listing per-layer
    settings that differ (``layer_types``, ``no_rope_layers``, ...), read at run time rather than stored."""
    two = hf_arch(config_name)
    if _layers_differ(two):
        return two
    return hf_arch_variant(config_name, _attn_implementation(config_name), **_one_layer_overrides(two.config))


def _attn_implementation(config_name: str) -> str:
    return "eager" if config_name in ("Gemma2Config", "GptOssConfig") else "sdpa"   # no SDPA path


def _decoder_layers(model):
    """The shortest-named ModuleList of the model's layers (model.layers, transformer.h, ...)."""
    lists = [(name, m) for name, m in model.named_modules()
             if isinstance(m, torch.nn.ModuleList) and len(m) == model.config.num_hidden_layers]
    return min(lists, key=lambda item: len(item[0]))[1] if lists else None


def _layer_signature(layer):
    signature = []
    for name, module in layer.named_modules():
        settings = {k: v for k, v in vars(module).items() if not k.startswith("_") and k != "layer_idx"
                    and isinstance(v, (int, float, str, bool, type(None), tuple))}
        signature.append((name, type(module).__name__, sorted(settings.items(), key=str)))
        signature.extend((name, p_name, tuple(p.shape)) for p_name, p in module.named_parameters(recurse=False))
    return signature


def _layers_differ(model) -> bool:
    layers = _decoder_layers(model)
    if layers is None or len(layers) < 2:
        return True
    per_layer_lists = [v for v in vars(model.config).values()
                       if isinstance(v, (list, tuple)) and len(v) == len(layers) and len(set(map(repr, v))) > 1]
    return bool(per_layer_lists) or any(_layer_signature(layer) != _layer_signature(layers[0])
                                        for layer in layers[1:])


def _one_layer_overrides(config) -> dict:
    overrides = {"num_hidden_layers": 1}
    for attr, value in vars(config).items():   # per-layer lists (all equal here) cut to one entry
        if isinstance(value, (list, tuple)) and len(value) == config.num_hidden_layers:
            overrides[attr] = type(value)(value[:1])
    for alias in ("n_layer", "n_layers"):   # GPT-2-style names, given by _HF_TINY too
        if isinstance(getattr(config, alias, None), int):
            overrides[alias] = 1
    return overrides


def hf_arch_variant(config_name: str, attn_implementation: str = "sdpa", **overrides):
    """hf_arch with another attention implementation and config overrides (a sliding window, ALiBi, ...)."""
    import inspect

    import transformers

    torch.manual_seed(0)
    cls = getattr(transformers, config_name)
    params = inspect.signature(cls.__init__).parameters
    kw = dict(_HF_SPECIAL.get(config_name) or {k: v for k, v in _HF_TINY.items() if k in params})
    config = cls(**{**kw, **overrides})
    # every dropout off (BioGPT's hidden_dropout_prob, OPT's layerdrop, ...): training steps must be deterministic
    for attr, value in list(vars(config).items()):
        if ("dropout" in attr or "pdrop" in attr or attr == "layerdrop") and isinstance(value, float) and value:
            setattr(config, attr, 0.0)
    return transformers.AutoModelForCausalLM.from_config(config, attn_implementation=attn_implementation).eval()


def hf_moe(config_name: str, experts: str = "grouped_mm"):
    """A tiny HF mixture-of-experts model with the given experts implementation (``grouped_mm``: sort, grouped
    matmul, un-permute, the default under ``torch.compile``; ``batched_mm``: one expert weight per token slot)."""
    model = hf_arch(config_name)
    model.set_experts_implementation(experts)
    return model


def hf_moe_with_aux_loss(config_name: str = "MixtralConfig"):
    """An HF mixture of experts that adds its load-balancing loss to the LM loss (``output_router_logits``):
    ``loss += coef * aux_loss``, in place."""
    return hf_arch_variant(config_name, "sdpa", output_router_logits=True, router_aux_loss_coef=0.02)


def hf_gpt_oss_windowed():
    """gpt-oss (eager attention with per-head sinks, MoE with biased experts), its sliding layers 6 tokens wide."""
    return hf_arch_variant("GptOssConfig", "eager", sliding_window=6)


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


def hf_inputs_single_sequence():
    g = torch.Generator().manual_seed(3)
    return torch.randint(0, 97, (1, 32), generator=g)


def hf_loss_with_attention_mask(model, ids):
    """As HF's Trainer calls a model on an unpadded batch: the tokenizer's all-ones attention_mask."""
    return model(input_ids=ids, labels=ids, attention_mask=torch.ones_like(ids), use_cache=False).loss


def hf_loss_with_padding(model, ids):
    """A padded batch: the second sequence's last 12 tokens are padding."""
    mask = torch.ones_like(ids)
    mask[-1, -12:] = 0
    return model(input_ids=ids, labels=ids, attention_mask=mask, use_cache=False).loss


def hf_loss_with_left_padding(model, ids):
    """A left-padded batch: the second sequence's first 12 tokens are padding (their query rows see no key)."""
    mask = torch.ones_like(ids)
    mask[-1, :12] = 0
    return model(input_ids=ids, labels=ids, attention_mask=mask, use_cache=False).loss


def packed_position_ids(batch: int, seq: int, lengths=(5, 1, 10)) -> torch.Tensor:
    """Packed documents as HF's ``DataCollatorWithFlattening`` passes them: each document's positions restart
    at 0 (documents of ``lengths``, the last one filling the row; each row shifted so boundaries differ)."""
    rows = []
    for b in range(batch):
        sizes = list(lengths[b % len(lengths):]) + list(lengths[:b % len(lengths)])
        sizes.append(seq - sum(sizes))
        rows.append(torch.cat([torch.arange(n) for n in sizes if n > 0]))
    return torch.stack(rows)


def hf_loss_num_items(model, ids):
    """As HF's Trainer calls a model under gradient accumulation: the loss summed and divided by the count of
    target tokens over all accumulation steps (``num_items_in_batch``), not by this batch's."""
    return model(input_ids=ids, labels=ids, use_cache=False, num_items_in_batch=torch.tensor(45)).loss


def hf_loss_packed(model, ids):
    """Packed documents: restarting position ids, the first token of every document not a target."""
    position_ids = packed_position_ids(*ids.shape)
    labels = ids.masked_fill(position_ids == 0, -100)
    return model(input_ids=ids, labels=labels, position_ids=position_ids, use_cache=False).loss


def hf_loss_left_padded(model, ids):
    """A left-padded batch (as generation-style tokenizers pad): the first row's first 9 tokens are padding,
    their labels ignored."""
    mask = torch.ones_like(ids)
    mask[0, :9] = 0
    return model(input_ids=ids, labels=ids.masked_fill(mask == 0, -100), attention_mask=mask, use_cache=False).loss


def hf_loss_left_padded_all_labels(model, ids):
    """:func:`hf_loss_left_padded` with the padding's labels kept: the rows that see only padding get a gradient."""
    mask = torch.ones_like(ids)
    mask[0, :9] = 0
    return model(input_ids=ids, labels=ids, attention_mask=mask, use_cache=False).loss


def hf_loss_padding_hole_then_left_padded(model, ids):
    """Two calls: a batch whose second row has a hole in its padding (tokens 10-13 masked out between real
    tokens, their labels ignored), then the left-padded batch of :func:`hf_loss_left_padded`; their losses summed."""
    mask = torch.ones_like(ids)
    mask[1, 10:14] = 0
    holed = model(input_ids=ids, labels=ids.masked_fill(mask == 0, -100), attention_mask=mask, use_cache=False).loss
    return holed + hf_loss_left_padded(model, ids)


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


def hf_loss_left_padded_autocast(model, ids):
    """hf_loss_left_padded under torch.autocast(bf16)."""
    with torch.autocast("cpu", dtype=torch.bfloat16):
        return hf_loss_left_padded(model, ids)


def hf_loss_packed_autocast(model, ids):
    """hf_loss_packed under torch.autocast(bf16): HF builds the packed documents' mask in fp32, the model's dtype."""
    with torch.autocast("cpu", dtype=torch.bfloat16):
        return hf_loss_packed(model, ids)


def hf_llama_checkpointed():
    """HF's activation checkpointing, as long-sequence training turns it on."""
    model = hf_llama()
    model.gradient_checkpointing_enable()
    return model.train()


def _save_matmuls_policy(ctx, op, *args, **kwargs):
    """torchtitan's op-level selective activation checkpointing with every matmul kept: the outputs of the matmuls
    and of attention (SDPA, or burstc's ring op once burstc has rewritten it) are saved, the rest recomputed."""
    from torch.utils.checkpoint import CheckpointPolicy

    saved = {torch.ops.aten.mm.default, torch.ops.aten.addmm.default, torch.ops.aten.bmm.default,
             torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default,
             torch.ops.aten._scaled_dot_product_efficient_attention.default,
             torch.ops.aten._scaled_dot_product_flash_attention.default,
             torch.ops.burstc.ring_attention_forward.default}
    return CheckpointPolicy.MUST_SAVE if op in saved else CheckpointPolicy.PREFER_RECOMPUTE


def save_matmuls_context():
    """``context_fn`` of ``torch.utils.checkpoint.checkpoint`` for the save-matmuls policy (a user's selective
    activation checkpointing, as torchtitan writes it)."""
    from torch.utils.checkpoint import create_selective_checkpoint_contexts

    import burstc.ops.ring_attention  # noqa: F401  (registers torch.ops.burstc.*)
    return create_selective_checkpoint_contexts(_save_matmuls_policy)


def hf_llama_sac_checkpointed():
    """HF's activation checkpointing with a selective policy (save every matmul and attention, recompute the
    rest), as ``gradient_checkpointing_kwargs`` passes it to ``torch.utils.checkpoint``."""
    model = hf_llama()
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False,
                                                                       "context_fn": save_matmuls_context})
    return model.train()


def hf_llama_every_other_layer_checkpointed():
    """transformers' newer entry point (``activation_checkpointing_enable``, 5.x; ``gradient_checkpointing_enable``
    is deprecated there) checkpointing every second decoder layer only."""
    model = hf_llama()
    if not hasattr(model, "activation_checkpointing_enable"):
        raise RuntimeError("this transformers has no activation_checkpointing_enable (before 5.x)")
    model.activation_checkpointing_enable(every_n_layers=2)
    return model.train()


def _llama_config(hidden: int, layers: int, heads: int, kv_heads: int, intermediate: int, vocab: int = 32000):
    import transformers

    return transformers.LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=intermediate,
                                    num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=kv_heads,
                                    max_position_embeddings=4096)


def llama_7b(layers: int = 32):
    """A Llama-2-7B-shaped model (hidden 4096, 32 layers, 32 heads, MHA as BurstEngine's 7B, intermediate 11008,
    vocab 32000) in bf16, random init: for ``burstc explain`` under ``torch.device("meta")``, where it allocates
    nothing (on a real device it takes 13 GB).  ``layers``: fewer decoder layers of the same width (quick tests)."""
    import transformers

    return transformers.LlamaForCausalLM(_llama_config(4096, layers, 32, 32, 11008)).to(torch.bfloat16)


def llama_7b_gqa(layers: int = 32):
    """:func:`llama_7b` with 8 kv heads (Llama-3-style GQA)."""
    import transformers

    return transformers.LlamaForCausalLM(_llama_config(4096, layers, 32, 8, 11008)).to(torch.bfloat16)


def llama_14b(layers: int = 40):
    """BurstEngine's "14B" (its ``13b`` config: hidden 5120, 40 layers, 40 heads, MHA, intermediate 13824, vocab
    120000, untied LM head: 13.9B parameters) in bf16, for ``burstc explain`` on the meta device."""
    import transformers

    return transformers.LlamaForCausalLM(_llama_config(5120, layers, 40, 40, 13824, vocab=120000)).to(torch.bfloat16)
