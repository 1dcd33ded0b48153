"""Activation checkpointing (HF's gradient_checkpointing_enable(), torchtitan's checkpoint_wrapper) under
sharding: the layers are inlined for the passes and checkpointed again afterwards, so the ring attention
is recomputed in the backward, and loss and gradients equal single-device eager."""
import pytest
import torch

from burstc.testing import assert_equivalent, zoo

pytestmark = pytest.mark.multirank

RING_FORWARD = "burstc.ring_attention_forward"


def _ops(gm, name):
    return sum(1 for n in gm.graph.nodes if n.op == "call_function" and name in str(n.target))


def _checkpointing_facts(world_size, model, inputs_fn, loss_fn, **options) -> dict:
    """One training step of ``burstc.compile(model, mesh, **options)`` -> ring forwards in the lowered backward
    graph, values the forward saves, the layers burstc tagged, the regions restored / kept inlined."""
    import burstc
    from torch.distributed.device_mesh import init_device_mesh

    torch._dynamo.reset()
    cmodel = burstc.compile(model, init_device_mesh("cpu", (world_size,)), backend="aot_eager", **options)
    loss_fn(cmodel, inputs_fn()).backward()
    report = burstc.report(cmodel)
    return dict(
        backward_ring_forwards=_ops(report.graphs["backward"], RING_FORWARD),
        forward_outputs=len(list(report.graphs["forward"].graph.output_node().args[0])),
        layers=[r.details["layer"] for r in report.rewrites if r.kind == "checkpoint_layers"],
        regions=[r.details["restored"] for r in report.rewrites if r.kind == "checkpoint_region"],
        kept=[s.reason for s in report.skipped if s.kind == "checkpoint_region"])


def checkpoint_task(rank, world_size, model_fn, inputs_fn, loss_fn):
    """The lowered graphs of a checkpointed and a plain compile of the same model."""
    return {label: _checkpointing_facts(world_size, fn(), inputs_fn, loss_fn)
            for label, fn in (("checkpointed", model_fn), ("plain", _plain[model_fn.__name__]))}


_plain = {"hf_llama_checkpointed": zoo.hf_llama, "titan_llama_checkpointed": zoo.titan_llama}
CASES = {
    # called as users do (use_cache left at its default): HF warns once and turns the cache off, which must
    # not break the graph, nor must the global that HF's kernelized layers set in every checkpointed forward
    "hf_llama": (zoo.hf_llama_checkpointed, zoo.hf_inputs, zoo.hf_loss_default),
    "titan_llama": (zoo.titan_llama_checkpointed, zoo.titan_inputs, zoo.call_with_loss),
}
CASE_NAMES = sorted(CASES)


@pytest.mark.parametrize("name", CASE_NAMES)
def test_checkpointed_model_matches_single_device(workers, name):
    if name.startswith("hf"):
        pytest.importorskip("transformers")
    model_fn, inputs_fn, loss_fn = CASES[name]
    results = assert_equivalent(model_fn, inputs_fn, loss_fn, world_size=2, group=workers.get(2),
                                backend="aot_eager")
    kinds = [k for k, _ in results[0]["rewrites"]]
    assert kinds.count("attention") == 2 and kinds.count("checkpoint_region") == 2 and "shard" in kinds


@pytest.mark.parametrize("name", CASE_NAMES)
def test_ring_is_recomputed_in_the_backward(workers, name):
    if name.startswith("hf"):
        pytest.importorskip("transformers")
    model_fn, inputs_fn, loss_fn = CASES[name]
    for found in workers.get(2).run(checkpoint_task, model_fn, inputs_fn, loss_fn):
        checkpointed, plain = found["checkpointed"], found["plain"]
        assert len(checkpointed["regions"]) == 2 and not checkpointed["kept"]
        assert all("ring_attention_forward" in line for line in checkpointed["regions"])
        # checkpointed: each layer's ring forward runs again in the backward, and the forward saves less
        assert checkpointed["backward_ring_forwards"] == 2 and plain["backward_ring_forwards"] == 0
        assert checkpointed["forward_outputs"] < plain["forward_outputs"]


def sac_task(rank, world_size):
    facts = _checkpointing_facts(world_size, zoo.hf_llama_sac_checkpointed(), zoo.hf_inputs, zoo.hf_loss_default)
    facts["plain"] = _checkpointing_facts(world_size, zoo.hf_llama_checkpointed(), zoo.hf_inputs,
                                          zoo.hf_loss_default)
    return facts


def test_user_selective_policy_keeps_working(workers):
    """A user's selective activation checkpointing (HF's gradient_checkpointing_kwargs with torchtitan's
    save-matmuls policy as context_fn) on a mesh: the regions go back with their policy, so the ring attention
    (saved by the policy) is not recomputed while the rest of the layer is; loss and gradients as single device."""
    pytest.importorskip("transformers")
    results = assert_equivalent(zoo.hf_llama_sac_checkpointed, zoo.hf_inputs, zoo.hf_loss_default, world_size=2,
                                group=workers.get(2), backend="aot_eager")
    kinds = [k for k, _ in results[0]["rewrites"]]
    assert kinds.count("attention") == 2 and kinds.count("checkpoint_region") == 2
    for facts in workers.get(2).run(sac_task):
        assert len(facts["regions"]) == 2 and not facts["kept"]
        # the policy saved the ring's outputs: no ring forward in the backward (plain checkpointing: one per layer)
        assert facts["backward_ring_forwards"] == 0 and facts["plain"]["backward_ring_forwards"] == 2
        assert facts["forward_outputs"] > facts["plain"]["forward_outputs"]  # it saves the matmuls too


def test_every_other_layer_checkpointed_by_the_newer_hf_entry_point(workers):
    transformers = pytest.importorskip("transformers")
    if not hasattr(transformers.PreTrainedModel, "activation_checkpointing_enable"):
        pytest.skip("transformers before 5.x: no activation_checkpointing_enable")
    results = assert_equivalent(zoo.hf_llama_every_other_layer_checkpointed, zoo.hf_inputs, zoo.hf_loss_default,
                                world_size=2, group=workers.get(2), backend="aot_eager")
    kinds = [k for k, _ in results[0]["rewrites"]]
    assert kinds.count("attention") == 2 and kinds.count("checkpoint_region") == 1  # of the 2 layers, one


def test_single_device_keeps_checkpointing():
    import burstc

    pytest.importorskip("transformers")
    torch._dynamo.reset()
    model = zoo.hf_llama_checkpointed()
    ids = zoo.hf_inputs()
    cmodel = burstc.compile(model, backend="aot_eager")
    loss = zoo.hf_loss_default(cmodel, ids)
    assert torch.allclose(loss, zoo.hf_loss_default(model, ids), rtol=1e-6)
    report = burstc.report(cmodel)
    assert len(report.graph_records) == 1
    assert _ops(report.graphs["rewritten"], "tag_activation_checkpoint") == 2


@pytest.mark.slow
def test_checkpointed_hf_llama_under_inductor(workers):
    pytest.importorskip("transformers")
    results = assert_equivalent(zoo.hf_llama_checkpointed, zoo.hf_inputs, zoo.hf_loss_default, world_size=2,
                                group=workers.get(2), backend="inductor", timeout=900)
    assert [k for k, _ in results[0]["rewrites"]].count("checkpoint_region") == 2


class _CountingLayer(torch.nn.Module):
    """A layer whose forward writes Python state outside itself, as HF's kernelized layers do."""
    calls = 0

    def __init__(self):
        super().__init__()
        self.proj = torch.nn.Linear(8, 8)

    def forward(self, x):
        type(self).calls += 1
        return torch.tanh(self.proj(x))


class _CheckpointedStack(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.layers = torch.nn.ModuleList(_CountingLayer() for _ in range(2))

    def forward(self, x):
        x = torch.utils.checkpoint.checkpoint(self.layers[0], 2 * x, use_reentrant=False)
        x = torch.utils.checkpoint.checkpoint(self.layers[1], x + 1, use_reentrant=False)
        return x.square().mean()


@pytest.mark.parametrize("replay", [False, True])
def test_side_effect_in_a_checkpointed_layer(replay):
    """Default: one graph, the side effect applied once per forward (not again in the recomputation) and
    gradients those of eager; replay_checkpoint_side_effects=True: torch.compile's graph break per layer."""
    import burstc

    torch._dynamo.reset()
    torch.manual_seed(0)
    model, x = _CheckpointedStack(), torch.randn(3, 8)
    _CountingLayer.calls = 0
    model(x).backward()
    assert _CountingLayer.calls == 4  # eager checkpointing replays each forward in the backward
    eager_grads = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    # one compiled step from the same counter value (Dynamo guards on it: another value recompiles)
    _CountingLayer.calls = 0
    cmodel = burstc.compile(model, backend="aot_eager", replay_checkpoint_side_effects=replay)
    cmodel(x).backward()
    for grad, expected in zip((p.grad for p in model.parameters()), eager_grads):
        torch.testing.assert_close(grad, expected)
    graphs = len(burstc.report(cmodel).graph_records)
    if replay:
        assert graphs > 1 and _CountingLayer.calls == 4  # eager checkpointing: forward + recomputation
    else:
        assert graphs == 1 and _CountingLayer.calls == 2
    assert torch._dynamo.config.skip_fwd_side_effects_in_bwd_under_checkpoint is False  # not leaked


# -- burstc's own checkpointing: checkpoint="layers" / "selective" ----------------------------------------------


def checkpoint_mode_task(rank, world_size, model_fn, inputs_fn, loss_fn, modes):
    """Per ``checkpoint=`` mode, the facts of one training step."""
    return {mode: _checkpointing_facts(world_size, model_fn(), inputs_fn, loss_fn, checkpoint=mode)
            for mode in modes}


MODE_CASES = {
    "titan_llama": (zoo.titan_llama, zoo.titan_inputs, zoo.call_with_loss),
    # the model's own checkpointing, made selective: its ring attention is kept, not recomputed
    "hf_llama_checkpointed": (zoo.hf_llama_checkpointed, zoo.hf_inputs, zoo.hf_loss_default),
}


@pytest.mark.parametrize("name", sorted(MODE_CASES))
def test_checkpoint_modes_recompute_layers_and_selective_keeps_the_ring(workers, name):
    if name.startswith("hf"):
        pytest.importorskip("transformers")
    model_fn, inputs_fn, loss_fn = MODE_CASES[name]
    for found in workers.get(2).run(checkpoint_mode_task, model_fn, inputs_fn, loss_fn,
                                    ("none", "layers", "selective")):
        none, layers, selective = found["none"], found["layers"], found["selective"]
        own = name.endswith("checkpointed")
        assert len(layers["regions"]) == 2 and len(selective["regions"]) == 2, found
        # burstc tags the decoder layers itself, unless the model checkpoints them already
        assert layers["layers"] == ([] if own else ["model.layers.0", "model.layers.1"]), layers["layers"]
        # layers: each ring forward runs again in the backward; selective: never
        assert layers["backward_ring_forwards"] == 2 and selective["backward_ring_forwards"] == 0
        assert none["backward_ring_forwards"] == (2 if own else 0)
        # what the forward saves: selective keeps O and LSE per layer on top of the layers' inputs
        assert layers["forward_outputs"] + 4 == selective["forward_outputs"]
        assert selective["forward_outputs"] < none["forward_outputs"] or own


@pytest.mark.parametrize("mode", ["layers", "selective"])
def test_checkpoint_modes_match_single_device(workers, mode):
    results = assert_equivalent(zoo.titan_llama, zoo.titan_inputs, zoo.call_with_loss, world_size=2,
                                group=workers.get(2), backend="aot_eager", checkpoint=mode)
    kinds = [k for k, _ in results[0]["rewrites"]]
    assert kinds.count("checkpoint_layers") == 2 and kinds.count("checkpoint_region") == 2, kinds


@pytest.mark.parametrize("mode, recomputed_attention", [("layers", 2), ("selective", 0)])
def test_checkpoint_modes_on_one_device(mode, recomputed_attention):
    """``checkpoint=`` without a mesh: the decoder layers are found and tagged the same way; "layers" recomputes
    each layer's SDPA in the backward (under run_with_rng_state), "selective" keeps SDPA's output; loss and
    gradients equal eager."""
    import burstc
    from burstc.testing.oracle import assert_same_training_step

    torch._dynamo.reset()
    model, inputs = zoo.titan_llama(), zoo.titan_inputs()
    cmodel = burstc.compile(model, None, backend="aot_eager", checkpoint=mode)
    assert_same_training_step(model, lambda m: zoo.call_with_loss(m, inputs), lambda: zoo.call_with_loss(cmodel, inputs))
    report = burstc.report(cmodel)
    assert [r.details["layer"] for r in report.rewrites if r.kind == "checkpoint_layers"] == [
        "model.layers.0", "model.layers.1"]
    assert _ops(report.graphs["backward"], "run_with_rng_state") == recomputed_attention
    saved = len(list(report.graphs["forward"].graph.output_node().args[0]))
    torch._dynamo.reset()
    plain = burstc.compile(zoo.titan_llama(), None, backend="aot_eager")
    zoo.call_with_loss(plain, inputs).backward()
    assert saved < len(list(burstc.report(plain).graphs["forward"].graph.output_node().args[0]))


@pytest.mark.parametrize("options", [{"checkpoint": "layers"}, {"checkpoint": "selective"},
                                     {"checkpoint": "selective", "checkpoint_keep": 0.5}],
                         ids=["layers", "selective", "selective_keep_half"])
def test_checkpoint_modes_on_nanogpt(workers, options):
    """nanoGPT-style blocks (``transformer.h.N``): found, checkpointed and exact in every mode."""
    results = assert_equivalent(zoo.nanogpt_sdpa, zoo.nanogpt_inputs, zoo.nanogpt_loss, world_size=2,
                                group=workers.get(2), backend="aot_eager", **options)
    kinds = [k for k, _ in results[0]["rewrites"]]
    assert kinds.count("checkpoint_layers") >= 2 and "shard" in kinds, kinds
    assert ("checkpoint_keep: 2 attention(s) keep the last" in results[0]["report"]) == ("checkpoint_keep" in options)
