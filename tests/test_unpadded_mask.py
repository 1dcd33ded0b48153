"""Models called with the tokenizer's ``attention_mask``.  HF's padding masks are recognized as key padding,
runtime data for the ring op: padded and unpadded batches share one sharded graph.  A mask burstc does not
take as data but that is causal when the input is all ones is specialized behind a runtime check, and a
padded batch runs an unsharded graph compiled for it; exact either way."""
import functools
import gc
import warnings

import pytest
import torch

from burstc.testing import assert_equivalent, zoo

transformers = pytest.importorskip("transformers")
pytestmark = pytest.mark.multirank


# OPT computes its positions with a cumsum over the attention_mask; GPT-2 and Llama only mask with it
@pytest.mark.parametrize("config_name", ["LlamaConfig", "OPTConfig", "GPT2Config"])
def test_all_ones_attention_mask_is_sharded(workers, config_name):
    results = assert_equivalent(functools.partial(zoo.hf_arch, config_name), zoo.hf_arch_batch_inputs,
                                zoo.hf_loss_with_attention_mask, world_size=2, group=workers.get(2),
                                backend="aot_eager")
    kinds = [k for k, _ in results[0]["rewrites"]]
    # the mask is key padding from the attention_mask: data for the op, no specialization
    assert "unpadded_mask" not in kinds and "shard" in kinds and kinds.count("attention") == 2
    assert all(m.startswith("causal&key_padding(") for m in results[0]["attention_masks"])


def _padded(ids, row, keep):
    mask = torch.ones_like(ids)
    mask[row, keep:] = 0
    return mask


def _ring_calls(fn):
    from burstc.ops.ring_attention import record_stats

    with record_stats() as stats:
        out = fn()
    return out, len(stats.of("forward"))


def _batches(masks, fresh):
    """The masks in order; ``fresh``: each a new tensor, the list emptied as it goes (as a data loader's
    batches are freed once used), so a compiled graph can't keep reading the first call's inputs."""
    if not fresh:
        yield from masks
        return
    while masks:
        yield masks.pop(0).clone()
        gc.collect()


def mixed_batches_task(rank, world_size, backend, fresh=False, model_name="hf_llama"):
    """All-ones, padded, all-ones again, padded: every call equals eager."""
    import burstc
    from torch.distributed.device_mesh import init_device_mesh

    torch._dynamo.reset()
    model = getattr(zoo, model_name)()
    ids = zoo.hf_inputs()
    cmodel = burstc.compile(model, init_device_mesh("cpu", (world_size,)), backend=backend)
    masks = [torch.ones_like(ids), _padded(ids, 1, 20), torch.ones_like(ids), _padded(ids, 0, 7)]
    calls = []
    for mask in _batches(masks, fresh):
        ids = ids.clone() if fresh else ids
        model.zero_grad(set_to_none=True)
        ref = model(input_ids=ids, labels=ids, attention_mask=mask, use_cache=False).loss
        ref.backward()
        ref_grads = {n: p.grad.clone() for n, p in model.named_parameters()}
        model.zero_grad(set_to_none=True)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            loss, ring_calls = _ring_calls(
                lambda: cmodel(input_ids=ids, labels=ids, attention_mask=mask, use_cache=False).loss)
        loss.backward()
        grad_error = max(float((p.grad - ref_grads[n]).abs().max() / ref_grads[n].abs().max().clamp_min(1e-12))
                         for n, p in model.named_parameters())
        calls.append(dict(loss_error=abs(float(loss) - float(ref)) / abs(float(ref)), grad_error=grad_error,
                          ring_calls=ring_calls, warned=any("not all ones" in str(w.message) for w in caught)))
    report = burstc.report(cmodel)
    return dict(calls=calls, graphs=len(report.graph_records), kinds=[r.kind for r in report.rewrites],
                skipped=[(s.kind, s.reason) for s in report.skipped])


# fresh: every batch a new tensor and the earlier ones freed, as a data loader does (a graph compiled later
# can't read the first call's inputs); Inductor with fresh batches only (its cold compiles cost CI ~10 s a case)
_BACKENDS = [("aot_eager", False), ("aot_eager", True), pytest.param("inductor", True, marks=pytest.mark.slow)]


@pytest.mark.parametrize("backend,fresh", _BACKENDS)
def test_padded_and_unpadded_batches_share_one_sharded_graph(workers, backend, fresh):
    results = workers.get(2).run(mixed_batches_task, backend, fresh, timeout=900)
    for result in results:
        calls = result["calls"]
        for call in calls:
            assert call["loss_error"] <= 1e-5 and call["grad_error"] <= 1e-5, call
        assert [c["ring_calls"] for c in calls] == [2, 2, 2, 2]               # every call sharded (2 layers)
        assert not any(c["warned"] for c in calls)
        assert result["graphs"] == 1                                           # no recompile, no fallback
        assert result["kinds"].count("shard") == 1 and "unpadded_mask" not in result["kinds"]


@pytest.mark.parametrize("backend,fresh", _BACKENDS)
def test_padding_mask_not_taken_as_data_runs_the_unsharded_fallback(workers, backend, fresh):
    # queries hidden too: not key padding; causal when all ones -> specialized, padded calls fall back
    results = workers.get(2).run(mixed_batches_task, backend, fresh, "query_key_padded", timeout=900)
    for result in results:
        calls = result["calls"]
        for call in calls:
            assert call["loss_error"] <= 1e-5 and call["grad_error"] <= 1e-5, call
        # sharded calls run the ring (1 layer); padded calls run the replicated fallback
        assert [c["ring_calls"] for c in calls] == [1, 0, 1, 0]
        assert [c["warned"] for c in calls] == [False, True, False, False]   # warned once
        assert result["graphs"] == 2                                           # fallback compiled once
        assert result["kinds"].count("shard") == 1 and result["kinds"].count("unpadded_mask") == 1
        fallback_notes = [r for k, r in result["skipped"] if k == "unpadded_mask"]
        assert len(fallback_notes) == 1 and "not all ones" in fallback_notes[0]


def test_padded_first_call_is_sharded(workers):
    # the call being compiled has padding: nothing to specialize on; the key padding is data, sharded, exact
    results = assert_equivalent(zoo.hf_llama, zoo.hf_inputs, zoo.hf_loss_with_padding, world_size=2,
                                group=workers.get(2), backend="aot_eager")
    kinds = [k for k, _ in results[0]["rewrites"]]
    assert "unpadded_mask" not in kinds and "shard" in kinds
    codes = [c for c in results[0]["skip_codes"] if c.startswith("unpadded_mask.")]
    assert codes == ["unpadded_mask.not_assumable"], results[0]["skipped"]


def test_windowed_padding_mask_is_sharded_as_data(workers):
    # a sliding window narrower than the sequence with key padding: causal & window & key padding, data
    # for the op (a mask that stays outside what the ring executes is refused with
    # unpadded_mask.not_causal_when_ones: test_mask_outside_what_the_ring_executes_is_not_specialized)
    results = assert_equivalent(zoo.windowed_hf_llama, zoo.hf_inputs, zoo.hf_loss_with_padding,
                                world_size=2, group=workers.get(2), backend="aot_eager")
    kinds = [k for k, _ in results[0]["rewrites"]]
    assert "unpadded_mask" not in kinds and "shard" in kinds
    assert {m.split(" ")[0].split("&key_padding")[0] for m in results[0]["attention_masks"]} == \
        {"causal&window(7,-)"}


def test_refused_graph_keeps_the_real_reason(workers):
    # a convolution over the sequence is refused whatever the mask: no runtime check is kept, and the report says why
    results = assert_equivalent(functools.partial(zoo.hf_arch, "Qwen3NextConfig"), zoo.hf_arch_batch_inputs,
                                zoo.hf_loss_with_attention_mask, world_size=2, group=workers.get(2),
                                backend="aot_eager", expect_sharded=False)
    kinds = [k for k, _ in results[0]["rewrites"]]
    assert "unpadded_mask" not in kinds and "shard" not in kinds
    # the padding mask is data (nothing specialized); the shard pass's own reason is the one reported
    assert [c for c in results[0]["skip_codes"] if c.startswith("shard.")], results[0]["skipped"]


def test_single_device_leaves_masks_alone():
    import burstc

    torch._dynamo.reset()
    model = zoo.hf_llama()
    ids = zoo.hf_inputs()
    cmodel = burstc.compile(model, backend="aot_eager")
    loss = zoo.hf_loss_with_attention_mask(cmodel, ids)
    assert torch.allclose(loss, zoo.hf_loss_with_attention_mask(model, ids), rtol=1e-6)
    runs = [p for p in burstc.report(cmodel).passes if p.name == "assume_unpadded"]
    assert runs and all(p.rewrites == 0 and "single device" in p.note for p in runs)


def test_mask_outside_what_the_ring_executes_is_not_specialized():
    """A mask built from an all-ones-able input that is still no MaskSpec with the input all ones (here
    block-diagonal chunks): assume_unpadded refuses with its code and leaves the graph alone (one process)."""
    import torch.nn.functional as F

    from burstc.config import BurstConfig
    from burstc.pass_context import PassContext
    from burstc.passes.assume_unpadded import assume_unpadded
    from burstc.report import Report
    from burstc.testing.graphs import dynamo_graph

    def chunked_attention(q, k, v, attention_mask):
        i = torch.arange(q.shape[-2])
        chunks = (i[:, None] // 4) == (i[None, :] // 4)
        allowed = chunks[None, None] & attention_mask.bool()[:, None, None, :]
        return F.scaled_dot_product_attention(q, k, v, attn_mask=allowed)

    def run_pass(gm, example_inputs):
        context = PassContext(report=Report(BurstConfig(), world_size=2), graph_id=0, world_size=2,
                              example_inputs=example_inputs)
        context.start_pass("assume_unpadded")
        assume_unpadded(gm, config=BurstConfig(), context=context)
        return context

    q, k, v = (torch.randn(1, 2, 16, 8) for _ in range(3))
    gm, context = dynamo_graph(chunked_attention, q, k, v, torch.ones(1, 16, dtype=torch.long), inside=run_pass)
    assert [s.code for s in context.report.skipped] == ["unpadded_mask.not_causal_when_ones"]
    assert context.facts.all_ones_inputs == () and context.report.rewrites == []
