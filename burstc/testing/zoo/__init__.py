"""The model zoo shared by tests, examples and benchmarks: small models written the way their source
projects write them (burstc never edits a model: these are "unmodified user code"), with seeded builders,
inputs and losses at module level (multi-rank tests pickle them to gloo workers).

- :mod:`.titan`: the torchtitan-style Llama (``burstc demo``'s default model) and models built on it;
- :mod:`.nanogpt`: the nanoGPT-style GPT (``examples/nanogpt.py`` trains it);
- :mod:`.hf`: tiny random-init Hugging Face causal LMs (``transformers`` imported lazily);
- :mod:`.handwritten`: small models that each probe one pass behaviour.
"""
from burstc.testing.zoo.titan import (  # noqa: F401
    TitanLlamaArgs,
    TitanLlama,
    WithLoss,
    titan_llama,
    titan_mha,
    titan_inputs,
    titan_inputs_odd_length,
    titan_inputs_odd_length_batch,
    call_with_loss,
    Regularized,
    regularized,
    WeightedPerTokenLoss,
    weighted_per_token_loss,
    single_sequence_inputs,
    titan_loss_autocast,
    titan_llama_checkpointed,
)
from burstc.testing.zoo.nanogpt import (  # noqa: F401
    GPTConfig,
    GPT,
    nanogpt_sdpa,
    nanogpt_manual,
    nanogpt_inputs,
    nanogpt_loss,
)
from burstc.testing.zoo.hf import (  # noqa: F401
    HF_ARCHITECTURES,
    hf_llama,
    hf_inputs,
    hf_loss_no_cache,
    hf_loss_default,
    hf_arch,
    hf_arch_checkpointed,
    hf_moe,
    hf_moe_with_aux_loss,
    hf_gpt_oss_windowed,
    hf_arch_variant,
    hf_arch_inputs,
    hf_arch_batch_inputs,
    hf_inputs_single_sequence,
    hf_loss_with_attention_mask,
    hf_loss_with_padding,
    hf_loss_packed,
    hf_loss_num_items,
    hf_loss_left_padded,
    hf_loss_left_padded_all_labels,
    hf_loss_padding_hole_then_left_padded,
    packed_position_ids,
    windowed_hf_llama,
    hf_loss_autocast,
    hf_llama_checkpointed,
    hf_llama_sac_checkpointed,
    hf_llama_every_other_layer_checkpointed,
    save_matmuls_context,
)
from burstc.testing.zoo.handwritten import (  # noqa: F401
    MeanPooled,
    mean_pooled,
    Bidirectional,
    bidirectional,
    InPlaceScatter,
    InPlaceLogits,
    InPlaceMask,
    InPlacePositions,
    PositionwiseMinMax,
    QueryKeyPadded,
    query_key_padded,
    narrow_values,
    wide_values,
    DocumentIdsMasked,
    document_ids_masked,
    document_ids_inputs,
    document_ids_loss,
)
