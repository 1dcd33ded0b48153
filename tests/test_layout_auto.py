"""``layout="auto"``: the shard pass picks one layout per graph for all its ring attentions
(:func:`burstc.cost_model.choose_layout`), reports why with each candidate's numbers, and the sharded model stays
exact."""
from __future__ import annotations

import functools

import pytest
import torch

from burstc.attention_ir import MaskSpec, SlidingWindow
from burstc.config import BurstConfig
from burstc.cost_model import (CPU_AS_H100_CLUSTER, H100_CLUSTER, NEAR_TIE, RingShape, choose_layout,
                               predicted_ring_cost)
from burstc.planner import cheaper_backward, predicted_transfers, predicted_work

CAUSAL = MaskSpec.causal()
DOCUMENTS = MaskSpec.decode("causal&documents(position_ids)")


@pytest.fixture(autouse=True)
def one_thread():
    # the geometry is many tiny tensor ops (searchsorted on a shard's positions): threads only contend
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def window(keys: int) -> MaskSpec:
    """HF's ``sliding_window=keys``: causal, ``keys`` keys including the query's own."""
    return CAUSAL & SlidingWindow(keys - 1)


def llama_8b(mask) -> RingShape:  # a Llama-3-8B-like layer in bf16
    return RingShape(mask, 1, 32, 8, 128, torch.bfloat16)


def tiny(mask) -> RingShape:
    return RingShape(mask, 1, 4, 2, 16, torch.float32)


def test_auto_is_the_default_and_validated():
    assert BurstConfig().layout == "auto"
    assert BurstConfig(layout="striped").layout == "striped"
    with pytest.raises(ValueError, match="layout"):
        BurstConfig(layout="balanced")


@pytest.mark.parametrize("shape,seq_len,world_size", [(tiny, 64, 2), (tiny, 96, 4), (llama_8b, 8192, 8)])
@pytest.mark.parametrize("mask", [CAUSAL, DOCUMENTS], ids=["causal", "documents"])
def test_causal_and_documents_get_zigzag(shape, seq_len, world_size, mask):
    # no window: the least busiest-rank work, which zigzag's exactly even causal split has, at any size (the cost
    # model would take contiguous at toy sizes, where its backward's fewer bytes outweigh the compute)
    choice = choose_layout([shape(mask)] * 3, seq_len, world_size, CPU_AS_H100_CLUSTER)
    assert choice.layout == "zigzag", choice.reason
    work = {layout: max(predicted_work(layout, CAUSAL, seq_len, world_size).per_rank) for layout in choice.costs}
    assert work["zigzag"] * world_size == sum(predicted_work("zigzag", CAUSAL, seq_len, world_size).per_rank)
    assert all(choice.costs[layout].work == 3 * shape(mask).heads_q * work[layout] for layout in work)
    assert work["zigzag"] < work["striped"] < work["contiguous"]
    assert "no sliding window" in choice.reason


@pytest.mark.parametrize("shape,seq_len,world_size,keys", [
    (tiny, 64, 2, 8), (tiny, 64, 4, 16),  # w <= S/P on toy shapes (comm-bound)
    (llama_8b, 8192, 8, 512), (llama_8b, 8192, 8, 1024),  # S/16 and S/P on an H100 cluster
])
def test_a_window_no_longer_than_a_shard_gets_contiguous(shape, seq_len, world_size, keys):
    machine = H100_CLUSTER if shape is llama_8b else CPU_AS_H100_CLUSTER
    choice = choose_layout([shape(window(keys))], seq_len, world_size, machine)
    assert choice.layout == "contiguous", choice.reason
    costs = choice.costs
    # striped does (a little) less work on its busiest rank, but sends whole shards: the cost model rules it out
    assert costs["striped"].work < costs["contiguous"].work
    assert costs["striped"].bytes > 2 * costs["contiguous"].bytes
    assert costs["contiguous"].seconds == min(c.seconds for c in costs.values())
    assert costs["contiguous"].bytes < costs["zigzag"].bytes


def test_a_window_longer_than_a_shard_follows_the_cost_model():
    # w = 2 S/P: contiguous leaves ranks 0 and 1 short of work; the pick is within NEAR_TIE of the fastest
    # and, among those, does the least work
    choice = choose_layout([llama_8b(window(2048))], 8192, 8, H100_CLUSTER)
    fastest = min(c.seconds for c in choice.costs.values())
    near = [name for name, c in choice.costs.items() if c.seconds <= fastest * (1 + NEAR_TIE)]
    assert choice.layout in near
    assert choice.costs[choice.layout].work == min(choice.costs[name].work for name in near)
    assert choice.layout != "striped"  # 3.5x contiguous's bytes


def test_mixed_layers_share_one_layout_chosen_on_the_total():
    # Gemma-3-style: five sliding-window layers (1024 keys) to one full (causal) layer, at S = 32K on 8 H100s
    seq_len, shape = 32768, (1, 32, 8, 128, torch.bfloat16)
    calls = [llama_8b(window(1024))] * 5 + [llama_8b(CAUSAL)]
    choice = choose_layout(calls, seq_len, 8, H100_CLUSTER)
    for layout, cost in choice.costs.items():  # each candidate's total is the sum over its calls
        parts = [predicted_ring_cost("flat", layout, call.mask, seq_len, 8, 1, *shape,
                                     cheaper_backward(predicted_transfers(layout, call.mask, seq_len, 8, *shape)),
                                     H100_CLUSTER).total for call in calls]
        assert cost.seconds == pytest.approx(sum(parts), rel=1e-12)
    # the windows alone would take contiguous; the causal layer's imbalance under it outweighs their halo bytes
    alone = choose_layout(calls[:5], seq_len, 8, H100_CLUSTER)
    assert alone.layout == "contiguous", alone.reason
    assert choice.layout == "zigzag", choice.reason
    assert choice.costs["zigzag"].seconds < choice.costs["contiguous"].seconds


def test_padding_a_mask_that_would_see_the_pads_excludes_the_layout():
    # 36 tokens on 4 ranks: zigzag pads to 40; a full (non-causal) mask would let real tokens see the pads
    choice = choose_layout([tiny(MaskSpec.full())], 36, 4, CPU_AS_H100_CLUSTER, pads_hidden=False)
    assert "zigzag" in choice.excluded and "zigzag" not in choice.costs
    assert choice.layout in ("contiguous", "striped")
    nowhere = choose_layout([tiny(MaskSpec.full())], 30, 4, CPU_AS_H100_CLUSTER, pads_hidden=False)
    assert nowhere.layout == "zigzag" and not nowhere.costs and len(nowhere.excluded) == 3  # the pass refuses it
    padded = choose_layout([tiny(CAUSAL)], 36, 4, CPU_AS_H100_CLUSTER)
    assert padded.costs["zigzag"].padded_len == 40 and padded.costs["contiguous"].padded_len == 36


# -- end to end: the shard pass picks, the report says why, the model stays exact -----------------------------

@pytest.mark.multirank
def test_windowed_model_gets_contiguous_and_is_exact(workers):
    pytest.importorskip("transformers")
    from burstc.testing import assert_equivalent, zoo

    # HF Mistral, sliding_window 8 on 1 x 32 tokens over 2 ranks: the window is half a shard
    results = assert_equivalent(functools.partial(zoo.hf_arch_variant, "MistralConfig", "sdpa", sliding_window=8),
                                zoo.hf_arch_inputs, zoo.hf_loss_no_cache, world_size=2, group=workers.get(2),
                                backend="aot_eager", expect_sharded=True, timeout=300)
    for result in results:
        details = result["shard_details"]
        assert details["layout"] == "contiguous", details
        assert set(details["layout_candidates"]) == {"zigzag", "contiguous", "striped"}
        candidates = details["layout_candidates"]
        assert candidates["contiguous"]["seconds"] < min(candidates["zigzag"]["seconds"],
                                                         candidates["striped"]["seconds"])
        assert details["layout_reason"].startswith("contiguous: a sliding window")
        assert "layout zigzag" not in result["report"]
