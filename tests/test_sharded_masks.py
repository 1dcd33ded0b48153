"""Masks beyond causal, sharded end to end on 2 gloo ranks: HF sliding windows shorter than the sequence (sdpa
and eager), HF eager attention (finfo.min masks), Gemma-2 as shipped (eager, soft-capped scores, alternating
windows), Falcon's ALiBi: loss and every parameter gradient equal single-device eager, and the report names the
mask each ring attention executes."""
from __future__ import annotations

import functools
import re

import pytest
import torch

transformers = pytest.importorskip("transformers")

from burstc.testing import assert_equivalent, zoo  # noqa: E402

S = 32  # hf_arch_inputs: 1 x 32 tokens; windows of 8 are shorter than a 16-token shard


CASES = {
    "mistral_window_sdpa": ("MistralConfig", "sdpa", {"sliding_window": 8}, {"causal&window(7,-)"}),
    "mistral_window_eager": ("MistralConfig", "eager", {"sliding_window": 8}, {"causal&window(7,-)"}),
    "qwen2_window_sdpa": ("Qwen2Config", "sdpa", {"sliding_window": 8, "use_sliding_window": True,
                                                  "max_window_layers": 0}, {"causal&window(7,-)"}),
    "llama_eager": ("LlamaConfig", "eager", {}, {"causal"}),
    # GPT-2's own eager attention: softmax(...).type(v.dtype)
    "gpt2_eager": ("GPT2Config", "eager", {}, {"causal"}),
    # Gemma-2 as shipped: eager, scores soft-capped at 50, sliding and global layers alternating
    "gemma2_softcap_alternating": ("Gemma2Config", "eager", {"sliding_window": 8},
                                   {"causal&window(7,-)&softcap(50.0)", "causal&softcap(50.0)"}),
    "gemma3_window_sdpa": ("Gemma3TextConfig", "sdpa", {"sliding_window": 8,
                                                        "layer_types": ["sliding_attention", "full_attention"]},
                           {"causal&window(7,-)", "causal"}),
    "falcon_alibi": ("FalconConfig", "sdpa", {"alibi": True, "new_decoder_architecture": False,
                                              "num_kv_heads": 4}, None),
    # MPT: (scores + alibi).masked_fill(mask, finfo.min); BLOOM: alibi.baddbmm(q, kᵀ) over [B * H, S, D] + mask,
    # its GELU a custom autograd function (pointwise both ways)
    "mpt_alibi": ("MptConfig", "eager", {}, None),
    "bloom_alibi": ("BloomConfig", "eager", {}, None),
}


def _executed_masks(described: list[str]) -> set[str]:
    """The MaskSpec encoding of every ring attention (its ``mask`` detail: encoding, then how it was found)."""
    return {"causal" if d == "is_causal" else d.split(" ")[0] for d in described}


@pytest.mark.parametrize("case", sorted(CASES))
def test_mask_is_sharded_and_exact(workers, case):
    config_name, impl, overrides, expected_masks = CASES[case]
    if not hasattr(transformers, config_name):
        pytest.skip(f"transformers has no {config_name}")
    results = assert_equivalent(functools.partial(zoo.hf_arch_variant, config_name, impl, **overrides),
                                zoo.hf_arch_inputs, zoo.hf_loss_no_cache, world_size=2, group=workers.get(2),
                                backend="aot_eager", expect_sharded=True, timeout=300)
    kinds = [k for k, _ in results[0]["rewrites"]]
    assert kinds.count("attention") == 2 and "shard" in kinds, results[0]["skipped"]
    masks = results[0]["attention_masks"]
    if expected_masks is not None:
        assert _executed_masks(masks) == expected_masks, masks
    else:  # ALiBi: the slopes are the model's
        assert all(m.startswith("causal&alibi(") for m in masks), masks


@pytest.mark.parametrize("layout,attention_plan", [("striped", "burst"), ("contiguous", "kv_ring")])
def test_windows_and_soft_cap_on_four_ranks(workers, layout, attention_plan):
    # Gemma-2 as shipped on 4 ranks (8 tokens each, the window 8 spans two shards), the other layouts and plans
    config_name, impl, overrides, expected_masks = CASES["gemma2_softcap_alternating"]
    results = assert_equivalent(functools.partial(zoo.hf_arch_variant, config_name, impl, **overrides),
                                zoo.hf_arch_inputs, zoo.hf_loss_no_cache, world_size=4, group=workers.get(4),
                                backend="aot_eager", expect_sharded=True, timeout=300, layout=layout,
                                attention_plan=attention_plan)
    assert _executed_masks(results[0]["attention_masks"]) == expected_masks


RUNTIME_CASES = {
    # packed documents: HF builds the document mask from the restarting position ids at run time
    "packed_position_ids": (zoo.hf_loss_packed, {"causal&documents"}),
    # padded batches (batch 2): right padding as the Trainer's collator pads, left padding as generation does
    "right_padded": (zoo.hf_loss_with_padding, {"causal&key_padding"}),
    "left_padded": (zoo.hf_loss_left_padded, {"causal&key_padding"}),
}


@pytest.mark.parametrize("case", sorted(RUNTIME_CASES))
def test_runtime_mask_is_sharded_and_exact(workers, case):
    """Masks whose values change every batch are graph inputs: the ring op gets this call's document ids /
    key validity, computed from the replicated token inputs (no all-ones guard, no unsharded fallback)."""
    loss_fn, expected = RUNTIME_CASES[case]
    results = assert_equivalent(zoo.hf_llama, zoo.hf_inputs, loss_fn, world_size=2, group=workers.get(2),
                                backend="aot_eager", expect_sharded=True, timeout=300)
    masks = {re.sub(r"\([^)]*\)", "", m.split(" ")[0]) for m in results[0]["attention_masks"]}
    assert masks == expected, results[0]["attention_masks"]
    # packed documents: layout "auto" balances each call's chunks (the documents layout); the others a static one
    layout = results[0]["shard_details"]["layout"]
    assert (layout == "documents") == (case == "packed_position_ids"), results[0]["shard_details"]


def hf_inputs_30_tokens():
    """Two rows of 30 tokens: not a multiple of 2P = 8 on 4 ranks (zigzag), so the layout pads to 32."""
    return torch.randint(1, 97, (2, 30), generator=torch.Generator().manual_seed(4))


@pytest.mark.parametrize("case", ["packed_position_ids", "right_padded"])
def test_runtime_mask_on_a_length_the_layout_pads(workers, case):
    """The layout's pads get a document of their own / are invalid keys: no real token sees them, so the
    sequence is padded and sharded instead of refused."""
    loss_fn, expected = RUNTIME_CASES[case]
    results = assert_equivalent(zoo.hf_llama, hf_inputs_30_tokens, loss_fn, world_size=4, group=workers.get(4),
                                backend="aot_eager", expect_sharded=True, timeout=300)
    assert results[0]["padded_to"] == 32
    assert (results[0]["shard_details"]["layout"] == "documents") == (case == "packed_position_ids")
    masks = {re.sub(r"\([^)]*\)", "", m.split(" ")[0]) for m in results[0]["attention_masks"]}
    assert masks == expected, results[0]["attention_masks"]


def test_document_ids_a_model_compares_itself(workers):
    """A model given document ids (unsorted: a document resumes after another) builds its own SDPA mask from
    them: recognized as causal & document_ids, sharded, exact."""
    results = assert_equivalent(zoo.document_ids_masked, zoo.document_ids_inputs, zoo.document_ids_loss,
                                world_size=2, group=workers.get(2), backend="aot_eager", expect_sharded=True)
    assert [m.split(" ")[0] for m in results[0]["attention_masks"]] == ["causal&document_ids(l_doc_ids_)"]


HIDDEN_ROW_CASES = {
    # HF eager adds finfo.min: a left-padded row's pads see only pads, and get eager's uniform average over all
    # keys with the gradients of a uniform softmax (the ring op's hidden_rows="uniform"): sharded
    "llama_right_padded": ("LlamaConfig", {}, zoo.hf_loss_with_padding, "uniform"),
    "llama_left_padded": ("LlamaConfig", {}, zoo.hf_loss_left_padded, "uniform"),
    "qwen2_gqa_left_padded": ("Qwen2Config", {}, zoo.hf_loss_left_padded, "uniform"),
    # MPT masked_fills its (ALiBi-biased) scores: the hidden rows' scores are replaced, no gradient through them
    "mpt_alibi_left_padded": ("MptConfig", {}, zoo.hf_loss_left_padded, "uniform_replaced"),
    # Gemma-2 soft-caps before adding the mask: the gradient through a hidden row's scores is per entry
    # (1 - tanh^2), computed from every hidden row's (q, dO) on every rank; the pads' labels kept, so those rows
    # carry a gradient, and a cap of 0.5 (not 50) so that it bends the tiny model's scores measurably
    "gemma2_softcap_left_padded": ("Gemma2Config", {"sliding_window": 8, "attn_logit_softcapping": 0.5},
                                   zoo.hf_loss_left_padded_all_labels, "uniform"),
}


@pytest.mark.parametrize("case", sorted(HIDDEN_ROW_CASES))
def test_eager_key_padding_with_fully_hidden_rows(workers, case):
    """HF eager fills padded scores with finfo.min: a query row whose every key is padding (left padding) gets
    eager's uniform average over all keys.  The ring op computes it, sharded and exact, soft-capped scores
    included (no call falls back to the unsharded graph)."""
    config_name, overrides, loss_fn, hidden_rows = HIDDEN_ROW_CASES[case]
    if not hasattr(transformers, config_name):
        pytest.skip(f"transformers has no {config_name}")
    results = assert_equivalent(functools.partial(zoo.hf_arch_variant, config_name, "eager", **overrides),
                                zoo.hf_arch_batch_inputs, loss_fn, world_size=2, group=workers.get(2),
                                backend="aot_eager", expect_sharded=True, timeout=300)
    assert "pipeline.hidden_rows_fallback" not in results[0]["skip_codes"], results[0]["skipped"]
    assert set(results[0]["hidden_rows"]) == {hidden_rows}, results[0]["hidden_rows"]
    masks = {re.sub(r"\([^)]*\)", "", m.split(" ")[0]) for m in results[0]["attention_masks"]}
    assert all(m.startswith("causal") and "key_padding" in m for m in masks), results[0]["attention_masks"]
    assert all("alibi" in m for m in masks) == ("Mpt" in config_name), results[0]["attention_masks"]


BLOOM_PADDED_CASES = {
    "right_padded": (zoo.hf_loss_with_padding, None),
    # the first row's pads see only pads: eager's uniform average over all keys, the ring op's hidden_rows="uniform"
    "left_padded": (zoo.hf_loss_left_padded, "uniform"),
    # a hole: BLOOM's ALiBi (counting real tokens) is not one ALiBi there, so that call runs the unsharded graph;
    # the left-padded call after it runs the sharded one
    "hole_then_left_padded": (zoo.hf_loss_padding_hole_then_left_padded, "uniform"),
}


@pytest.mark.parametrize("case", sorted(BLOOM_PADDED_CASES))
def test_bloom_padded_batch(workers, case):
    """BLOOM builds its ALiBi from the attention_mask's running count of real tokens: for contiguous padding
    that is standard ALiBi up to a constant per query row (which the softmax ignores) with key padding, sharded
    and exact; a call whose padding has a hole runs the unsharded graph (exact), with the reason reported."""
    loss_fn, hidden_rows = BLOOM_PADDED_CASES[case]
    results = assert_equivalent(functools.partial(zoo.hf_arch_variant, "BloomConfig", "eager"),
                                zoo.hf_arch_batch_inputs, loss_fn, world_size=2, group=workers.get(2),
                                backend="aot_eager", expect_sharded=True, timeout=300)
    masks = results[0]["attention_masks"]
    assert len(masks) == 2 and all(m.startswith("causal&key_padding(l_kwargs_attention_mask_,contiguous)&alibi(")
                                   for m in masks), masks
    if hidden_rows is not None:
        assert set(results[0]["hidden_rows"]) == {hidden_rows}, results[0]["hidden_rows"]
    holed = case.startswith("hole")
    assert ("pipeline.padding_hole_fallback" in results[0]["skip_codes"]) == holed, results[0]["skipped"]
    assert "pipeline.hidden_rows_fallback" not in results[0]["skip_codes"], results[0]["skipped"]
    if holed:  # the unsharded graph's summary line says why it is replicated
        summary = next(line for line in results[0]["report"].splitlines() if line.startswith("graph 1:"))
        assert "replicated on 2 ranks" in summary and "not one contiguous run" in summary, results[0]["report"]
