"""burstc.compile(model, mesh) on P gloo ranks: every rank gets the single-device eager loss and
parameter gradients (burstc.testing.assert_equivalent), for unmodified models."""
import functools

import pytest
import torch

from burstc.testing import assert_equivalent, zoo

pytestmark = pytest.mark.multirank


MODELS = {
    "titan_llama_gqa": (zoo.titan_llama, zoo.titan_inputs, zoo.call_with_loss),
    "titan_llama_mha": (zoo.titan_mha, zoo.titan_inputs, zoo.call_with_loss),
    "nanogpt_sdpa": (zoo.nanogpt_sdpa, zoo.nanogpt_inputs, zoo.nanogpt_loss),
    "nanogpt_manual": (zoo.nanogpt_manual, zoo.nanogpt_inputs, zoo.nanogpt_loss),
    "hf_llama": (zoo.hf_llama, zoo.hf_inputs, zoo.hf_loss_no_cache),
    "hf_llama_cache": (zoo.hf_llama, zoo.hf_inputs, zoo.hf_loss_default),
    # gradient accumulation: the summed loss over a token count from all steps (a graph input, not this
    # batch's count); the sharded loss must divide by the same number
    "hf_llama_num_items_in_batch": (zoo.hf_llama, zoo.hf_inputs, zoo.hf_loss_num_items),
}


ON_FOUR_RANKS_TOO = ("titan_llama_gqa", "titan_llama_mha", "nanogpt_sdpa", "nanogpt_manual", "hf_llama")


def _attention_plans(results):
    return {plan for kind, plan in results[0]["rewrites"] if kind == "attention"}


# every model on 2 and 4 ranks; the cache and the token count, loss-side features, on 2 only (7 s each on 4)
@pytest.mark.parametrize("name, world_size", [(name, world_size) for name in sorted(MODELS) for world_size in (2, 4)
                                               if world_size == 2 or name in ON_FOUR_RANKS_TOO])
def test_model_matches_single_device(workers, name, world_size):
    pytest.importorskip("transformers") if name.startswith("hf") else None
    model_fn, inputs_fn, loss_fn = MODELS[name]
    results = assert_equivalent(model_fn, inputs_fn, loss_fn, world_size=world_size,
                                group=workers.get(world_size), backend="aot_eager")
    kinds = [k for k, _ in results[0]["rewrites"]]
    assert kinds.count("lm_head_loss") == 1 and kinds.count("shard") == 1
    assert kinds.count("attention") == (1 if name == "titan_llama_mha" else 2)
    # every rank returns the same loss
    assert len({r["loss"] for r in results}) == 1


@pytest.mark.parametrize("plan", ["kv_ring", "burst"])
@pytest.mark.parametrize("layout", ["contiguous", "zigzag", "striped"])
def test_layouts_and_plans(workers, layout, plan):
    results = assert_equivalent(zoo.titan_llama, zoo.titan_inputs, zoo.call_with_loss, world_size=2,
                                group=workers.get(2), backend="aot_eager", layout=layout, attention_plan=plan)
    assert _attention_plans(results) == {plan}


def test_planner_picks_burst_for_mha_and_kv_ring_for_gqa(workers):
    pytest.importorskip("transformers")
    mha = assert_equivalent(zoo.titan_mha, zoo.titan_inputs, zoo.call_with_loss, world_size=2,
                            group=workers.get(2), backend="aot_eager")
    # HF's cache path calls SDPA with enable_gqa=True; its no-cache path and torchtitan repeat the kv
    # heads themselves (repeat_kv), which detect_attention undoes: 2 kv heads travel, not 4
    for loss_fn in (zoo.hf_loss_default, zoo.hf_loss_no_cache):
        gqa = assert_equivalent(zoo.hf_llama, zoo.hf_inputs, loss_fn, world_size=2,
                                group=workers.get(2), backend="aot_eager")
        assert _attention_plans(gqa) == {"kv_ring"}
    titan = assert_equivalent(zoo.titan_llama, zoo.titan_inputs, zoo.call_with_loss, world_size=2,
                              group=workers.get(2), backend="aot_eager")
    assert _attention_plans(titan) == {"kv_ring"}
    assert "kv_heads_on_wire=2" in titan[0]["report"]
    assert _attention_plans(mha) == {"burst"}


def test_bf16(workers):
    assert_equivalent(zoo.titan_llama, zoo.titan_inputs, zoo.call_with_loss, world_size=2,
                      group=workers.get(2), backend="aot_eager", dtype=torch.bfloat16)


@pytest.mark.parametrize("name", ["hf_llama", "titan_llama", "hf_llama_eager", "gemma2_eager_left_padded",
                                  "cohere2_eager_packed", "gpt_oss_eager"])
def test_autocast(workers, name):
    # fp32 parameters, bf16 autocast: the ring and the fused loss cast like the SDPA and linear they replace;
    # HF's eager attention under autocast mixes fp32 q/k (after RoPE) with bf16 v in its matmuls (found by the
    # fuzzer: 18 of 20 such cases ran replicated), canonicalized to SDPA, or (Gemma-2's soft-cap, a padded
    # batch's float fill) left as written and replaced by the ring, on q, k, v cast as autocast casts them
    pytest.importorskip("transformers") if name.startswith(("hf", "gemma")) else None
    model_fn, inputs_fn, loss_fn = {
        "hf_llama": (zoo.hf_llama, zoo.hf_inputs, zoo.hf_loss_autocast),
        "titan_llama": (zoo.titan_llama, zoo.titan_inputs, zoo.titan_loss_autocast),
        "hf_llama_eager": (functools.partial(zoo.hf_arch_variant, "LlamaConfig", "eager"), zoo.hf_arch_inputs,
                           zoo.hf_loss_autocast),
        "gemma2_eager_left_padded": (functools.partial(zoo.hf_arch, "Gemma2Config"), zoo.hf_arch_batch_inputs,
                                     zoo.hf_loss_left_padded_autocast),
        # q, k, v bf16 already (RoPE's result cast back), packed documents' fp32 mask: cast for SDPA
        "cohere2_eager_packed": (functools.partial(zoo.hf_arch_variant, "Cohere2Config", "eager"),
                                 zoo.hf_arch_inputs, zoo.hf_loss_packed_autocast),
        # attention sinks, left as written and replaced by the ring
        "gpt_oss_eager": (functools.partial(zoo.hf_arch, "GptOssConfig"), zoo.hf_arch_inputs,
                          zoo.hf_loss_autocast)}[name]
    results = assert_equivalent(model_fn, inputs_fn, loss_fn, world_size=2, group=workers.get(2),
                                backend="aot_eager", tolerance_dtype=torch.bfloat16)
    kinds = [k for k, _ in results[0]["rewrites"]]
    assert kinds.count("attention") == 2 and kinds.count("lm_head_loss") == 1
    # HF's RoPE leaves q, k fp32: the rings run on q, k, v cast to bf16 (the report's cast_to); torchtitan's and
    # Cohere-2's cast RoPE's result back to bf16: nothing to cast
    casts = None if name in ("titan_llama", "cohere2_eager_packed") else "bfloat16"
    assert results[0]["attention_casts"] == [casts] * 2


@pytest.mark.slow
def test_inductor(workers):
    assert_equivalent(zoo.titan_llama, zoo.titan_inputs, zoo.call_with_loss, world_size=2,
                      group=workers.get(2), backend="inductor", timeout=900)


@pytest.mark.parametrize("model_fn, head_dim", [(zoo.narrow_values, "12qk/8v (ring 12)"),
                                                (zoo.wide_values, "4qk/8v (ring 8)")], ids=["narrow_v", "wide_v"])
def test_values_narrower_or_wider_than_queries(workers, model_fn, head_dim):
    # DeepSeek's latent attention gives values another width than queries/keys: the ring pads the narrower side
    # with zeros (nothing added to q.k, zero output columns) and slices the output back
    results = assert_equivalent(model_fn, zoo.titan_inputs, zoo.call_with_loss, world_size=2,
                                group=workers.get(2), backend="aot_eager", layout="zigzag")
    assert "shard" in [k for k, _ in results[0]["rewrites"]]
    assert head_dim in results[0]["report"], results[0]["report"]


def test_position_mixing_model_is_refused_and_still_exact(workers):
    results = assert_equivalent(zoo.max_pooled, zoo.titan_inputs, zoo.call_with_loss, world_size=2,
                                group=workers.get(2), backend="aot_eager", expect_sharded=False)
    assert [c for c in results[0]["skip_codes"] if c.startswith("shard.")] == ["shard.reduces_sequence"]


@pytest.mark.parametrize("world_size, layout", [(2, "zigzag"), (3, "contiguous")])
def test_mean_over_the_sequence_is_sharded_and_exact(workers, world_size, layout):
    """h + h.mean(dim=1): each rank sums its tokens, all-reduce, / the whole count; on 3 ranks the 16 tokens are
    padded to 18, and the pads must not count."""
    results = assert_equivalent(zoo.mean_pooled, zoo.titan_inputs, zoo.call_with_loss, world_size=world_size,
                                group=workers.get(world_size), backend="aot_eager", layout=layout)
    report = results[0]["report"]
    assert "means_over_ranks=1" in report and "sums_over_ranks=1" in report, report


def test_sum_over_the_sequence_used_by_every_token_gets_the_whole_gradient(workers):
    """h + c * h.sum(1): the sum's gradient arrives in parts, one per rank's tokens; its all-reduce sums the
    gradient too (with an identity backward, each rank's embedding gradient missed the other ranks' parts)."""
    results = assert_equivalent(zoo.sum_pooled, zoo.titan_inputs, zoo.call_with_loss, world_size=2,
                                group=workers.get(2), backend="aot_eager")
    assert "sums_over_ranks=1" in results[0]["report"]


def test_replicated_term_added_to_the_loss_is_refused_and_still_exact(workers):
    results = assert_equivalent(zoo.regularized, zoo.titan_inputs, zoo.call_with_loss, world_size=2,
                                group=workers.get(2), backend="aot_eager", expect_sharded=False)
    assert [c for c in results[0]["skip_codes"] if c.startswith("shard.")] == ["shard.replicated_gradients"], \
        results[0]["skipped"]


def test_length_the_layout_cannot_split_is_padded_when_exact(workers):
    # 30 tokens on 4 zigzag ranks (a multiple of 8 is needed): causal attention and ignored targets
    # make padding to 32 exact
    results = assert_equivalent(zoo.titan_llama, zoo.titan_inputs_odd_length, zoo.call_with_loss, world_size=4,
                                group=workers.get(4), backend="aot_eager")
    assert "padded_to=32" in results[0]["report"]


def test_bidirectional_model_matches_when_divisible(workers):
    assert_equivalent(zoo.bidirectional, zoo.titan_inputs, zoo.call_with_loss, world_size=2,
                      group=workers.get(2), backend="aot_eager")


def test_length_that_padding_cannot_fix_runs_replicated_and_exact(workers):
    # 30 tokens on 4 zigzag ranks, bidirectional attention: a real token would see the pads, so the graph is
    # refused (not an error) and runs replicated
    results = assert_equivalent(zoo.bidirectional, zoo.titan_inputs_odd_length, zoo.call_with_loss, world_size=4,
                                group=workers.get(4), backend="aot_eager", expect_sharded=False)
    assert "shard.padding_not_exact" in results[0]["skip_codes"], results[0]["skipped"]
    assert "shard" not in [k for k, _ in results[0]["rewrites"]]


def _differently_initialized(rank, world_size, **options):
    """Every rank builds the model from its own seed (no torch.manual_seed shared): burstc.compile takes
    rank 0's weights, as DDP does; with sync_module_states=False the ranks keep their own."""
    import burstc
    from torch.distributed.device_mesh import init_device_mesh

    torch._dynamo.reset()
    model = zoo.titan_llama()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.01 * rank)
    tokens, labels = zoo.titan_inputs()
    cmodel = burstc.compile(model, init_device_mesh("cpu", (world_size,)), backend="aot_eager", **options)
    loss = cmodel(tokens, labels)
    reference = zoo.titan_llama()(tokens, labels)  # rank 0's weights (offset 0)
    return float((loss - reference).abs())


def test_compile_takes_the_first_ranks_weights(workers):
    errors = workers.get(2).run(_differently_initialized)
    assert max(errors) < 1e-5, errors
    # the check that it is the broadcast that fixes it: without it the mixed weights give another loss
    unsynced = workers.get(2).run(_differently_initialized, sync_module_states=False)
    assert max(unsynced) > 1e-4, unsynced


def _different_batches(rank, world_size, **options):
    import burstc
    from torch.distributed.device_mesh import init_device_mesh

    torch._dynamo.reset()
    cmodel = burstc.compile(zoo.titan_llama(), init_device_mesh("cpu", (world_size,)), backend="aot_eager",
                            **options)
    tokens, labels = zoo.titan_inputs()
    if rank == 1:
        tokens = (tokens + 1) % 97
    try:
        cmodel(tokens, labels)
    except RuntimeError as e:
        return str(e)
    return "no error"


def test_check_inputs_detects_different_batches(workers):
    # on by default: a rank fed its own batch is an error, not a silently wrong loss
    messages = workers.get(2).run(_different_batches)
    assert all("different batches" in m for m in messages), messages
    assert workers.get(2).run(_different_batches, check_inputs=False) == ["no error", "no error"]


def _kept_logits(rank, world_size):
    import burstc
    from torch.distributed.device_mesh import init_device_mesh

    torch._dynamo.reset()
    model = zoo.nanogpt_sdpa()
    x, y = zoo.nanogpt_inputs()
    ref_logits, ref_loss = model(x, y)
    cmodel = burstc.compile(model, init_device_mesh("cpu", (world_size,)), backend="aot_eager", keep_logits=True)
    logits, loss = cmodel(x, y)
    # a loss on the gathered (full, replicated) logits: its gradient must flow back exactly once
    (logits.float().pow(2).mean() + loss).backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad()
    (ref_logits.float().pow(2).mean() + ref_loss).backward()
    worst = max(float((grads[n] - p.grad).abs().max() / p.grad.abs().max().clamp_min(1e-6))
                for n, p in model.named_parameters())
    return float((logits - ref_logits).abs().max()), float((loss - ref_loss).abs()), worst, str(burstc.report(cmodel))


def test_kept_logits_are_gathered_full_and_differentiable(workers):
    for logits_err, loss_err, grad_err, report in workers.get(2).run(_kept_logits):
        assert "gathered_outputs" in report
        assert logits_err < 1e-5 and loss_err < 1e-5 and grad_err < 1e-4, (logits_err, loss_err, grad_err)


def _router_logits(rank, world_size):
    """Mixtral with its load-balancing loss at batch 2: the router logits it returns are [B * S, experts], merged
    (batch, token) rows, gathered whole; a loss on them sends each rank its own rows' gradient."""
    import burstc
    from torch.distributed.device_mesh import init_device_mesh

    torch._dynamo.reset()
    model = zoo.hf_moe_with_aux_loss()
    ids = zoo.hf_arch_batch_inputs()

    def step(m):
        out = m(input_ids=ids, labels=ids, use_cache=False)
        (out.loss + sum(r.float().pow(2).mean() for r in out.router_logits)).backward()
        grads = {n: p.grad.clone() for n, p in model.named_parameters()}
        model.zero_grad()
        return out, grads

    ref, ref_grads = step(model)
    cmodel = burstc.compile(model, init_device_mesh("cpu", (world_size,)), backend="aot_eager")
    out, grads = step(cmodel)
    worst = max(float((grads[n] - g).abs().max() / g.abs().max().clamp_min(1e-6)) for n, g in ref_grads.items())
    router_err = max(float((r - e).abs().max()) for r, e in zip(out.router_logits, ref.router_logits))
    shard = [r.details.get("gathered_outputs") for r in burstc.report(cmodel).rewrites if r.kind == "shard"]
    return router_err, float((out.aux_loss - ref.aux_loss).abs()), worst, shard


def test_merged_rows_outputs_are_gathered_full_and_differentiable(workers):
    for router_err, aux_err, grad_err, gathered in workers.get(2).run(_router_logits):
        assert gathered and len(gathered[0]) == 2, gathered  # one [B * S, experts] output per layer
        assert router_err < 1e-5 and aux_err < 1e-6 and grad_err < 1e-4, (router_err, aux_err, grad_err)


def _evaluation_logits(rank, world_size):
    """HF Llama evaluated under no_grad on the mesh: the default keeps the logits (gathered, full)."""
    import burstc
    from torch.distributed.device_mesh import init_device_mesh

    torch._dynamo.reset()
    model = zoo.hf_llama()
    ids = zoo.hf_inputs()
    with torch.no_grad():
        ref = model(input_ids=ids, labels=ids, use_cache=False)
        cmodel = burstc.compile(model, init_device_mesh("cpu", (world_size,)), backend="aot_eager")
        out = cmodel(input_ids=ids, labels=ids, use_cache=False)
    kinds = [r.kind for r in burstc.report(cmodel).rewrites]
    return float((out.logits - ref.logits).abs().max()), float((out.loss - ref.loss).abs()), kinds


def test_evaluation_keeps_logits_on_the_mesh(workers):
    pytest.importorskip("transformers")
    for logits_err, loss_err, kinds in workers.get(2).run(_evaluation_logits):
        assert kinds.count("lm_head_loss") == 1 and kinds.count("shard") == 1, kinds
        assert logits_err < 1e-5 and loss_err < 1e-5, (logits_err, loss_err)


def _shard_rewrites(results):
    return [kind for kind, _ in results[0]["rewrites"]]


@pytest.mark.parametrize("world_size, layout, reduction, smoothing", [
    (2, "zigzag", "mean", 0.1), (3, "striped", "sum", 0.0)])
def test_next_token_shift_inside_the_model_is_sharded(workers, world_size, layout, reduction, smoothing):
    """``logits[..., :-1, :]`` against ``labels[..., 1:]`` in the model (HF 4.x, much training code): sharded, not
    refused for slicing the sequence; the last position's target is ignore_index on whichever rank holds it."""
    results = assert_equivalent(functools.partial(zoo.nanogpt_next_token, reduction, smoothing),
                                zoo.next_token_inputs, zoo.next_token_loss, world_size=world_size,
                                group=workers.get(world_size), backend="aot_eager", layout=layout)
    kinds = _shard_rewrites(results)
    assert kinds.count("shard") == 1 and kinds.count("lm_head_loss") == 1 and kinds.count("attention") == 2
    assert "as ignored targets" in results[0]["report"]


@pytest.mark.parametrize("style, reduction, world_size", [
    ("nll", "mean", 2), ("classes_in_dim_1", "none", 3)])
def test_unfused_nll_and_sequence_layout_losses_are_sharded(workers, style, reduction, world_size):
    """Left unfused (here: the fusion off; in models, e.g. logits scaled after their upcast or by a tensor),
    ``nll_loss(log_softmax(logits))`` on flattened tokens and cross-entropy on CE's ``[B, V, S]`` layout
    shard like ``cross_entropy`` on ``[tokens, V]``: per-token losses of the local rows, gathered, reduced."""
    results = assert_equivalent(functools.partial(zoo.nanogpt_loss_style, style, reduction), zoo.nanogpt_inputs,
                                zoo.loss_style_loss, world_size=world_size, group=workers.get(world_size),
                                backend="aot_eager", disable_passes=("fuse_lm_head_loss",))
    kinds = _shard_rewrites(results)
    assert kinds.count("shard") == 1 and "lm_head_loss" not in kinds


def test_unfused_cross_entropy_is_sharded(workers):
    # the LM-head fusion switched off: cross_entropy on this rank's logits rows, per-token losses
    # gathered, HF's mean over the non-ignored labels (B = 1: the sequence is the flattened token dim)
    pytest.importorskip("transformers")
    for world_size in (2, 4):
        results = assert_equivalent(zoo.hf_llama, zoo.hf_inputs_single_sequence, zoo.hf_loss_no_cache,
                                    world_size=world_size, group=workers.get(world_size), backend="aot_eager",
                                    disable_passes=("fuse_lm_head_loss",))
        kinds = _shard_rewrites(results)
        assert "lm_head_loss" not in kinds and kinds.count("shard") == 1 and kinds.count("attention") == 2


@pytest.mark.parametrize("fused", [True, False])
def test_per_token_losses_are_gathered(workers, fused):
    options = {} if fused else {"disable_passes": ("fuse_lm_head_loss",)}
    results = assert_equivalent(zoo.weighted_per_token_loss, zoo.single_sequence_inputs, zoo.call_with_loss,
                                world_size=2, group=workers.get(2), backend="aot_eager", **options)
    kinds = _shard_rewrites(results)
    assert kinds.count("lm_head_loss") == (1 if fused else 0) and kinds.count("shard") == 1


def test_unfused_cross_entropy_over_a_batch_is_sharded(workers):
    # B = 2 flattened with the sequence (torchtitan's flatten(0, 1)): merged (batch, token) rows
    for world_size in (2, 4):
        results = assert_equivalent(zoo.titan_llama, zoo.titan_inputs, zoo.call_with_loss, world_size=world_size,
                                    group=workers.get(world_size), backend="aot_eager",
                                    disable_passes=("fuse_lm_head_loss",))
        assert _shard_rewrites(results).count("attention") == 2


def test_merged_batch_and_sequence_rows_with_padding(workers):
    # 30 tokens on 4 zigzag ranks: padded to 32; the merged rows carry the pads, their targets ignored
    assert_equivalent(zoo.titan_llama, zoo.titan_inputs_odd_length_batch, zoo.call_with_loss, world_size=4,
                      group=workers.get(4), backend="aot_eager", disable_passes=("fuse_lm_head_loss",))


def test_positionwise_min_max_and_like_ops_are_sharded(workers):
    results = assert_equivalent(zoo.PositionwiseMinMax, zoo.titan_inputs, zoo.call_with_loss, world_size=2,
                                group=workers.get(2), backend="aot_eager")
    assert _shard_rewrites(results).count("attention") == 1
