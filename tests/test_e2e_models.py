"""burstc.compile on unmodified models, one device: exactly one lm_head_loss rewrite, and loss and
every parameter gradient equal eager."""
import pytest
import torch

import burstc
from burstc.guards import DROPPED_LOGITS
from burstc.testing import assert_same_training_step
from burstc.testing.zoo import GPT, GPTConfig

transformers = pytest.importorskip("transformers")


def tiny_hf_llama(layers=2, vocab=211):
    config = transformers.LlamaConfig(vocab_size=vocab, hidden_size=32, intermediate_size=64,
                                      num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2,
                                      max_position_embeddings=128)
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(config)


def _check_single_rewrite(cmodel):
    rep = burstc.report(cmodel)
    assert [r.kind for r in rep.rewrites] == ["lm_head_loss"], str(rep)
    assert {"captured", "rewritten", "forward", "backward"} <= set(rep.graphs)
    return rep


@pytest.mark.parametrize("backend", ["aot_eager", pytest.param("inductor", marks=pytest.mark.slow)])
def test_hf_llama(backend):
    model = tiny_hf_llama(layers=1 if backend == "inductor" else 2)
    ids = torch.randint(0, 211, (2, 24))
    labels = ids.clone()
    labels[0, :5] = -100
    cmodel = burstc.compile(model, backend=backend)
    run = lambda m: m(input_ids=ids, labels=labels, use_cache=False).loss
    outputs = {}

    def compiled_run():
        out = cmodel(input_ids=ids, labels=labels, use_cache=False)
        outputs["logits"] = out.logits
        return out.loss

    assert_same_training_step(model, run, compiled_run)
    assert outputs["logits"] is DROPPED_LOGITS  # never materialized
    rep = _check_single_rewrite(cmodel)
    assert rep.rewrites[0].module_path == "lm_head"


def test_hf_llama_tied_embeddings_keep_logits():
    config = transformers.LlamaConfig(vocab_size=97, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                      num_attention_heads=4, num_key_value_heads=4, tie_word_embeddings=True)
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config)
    assert model.lm_head.weight is model.model.embed_tokens.weight
    ids = torch.randint(0, 97, (1, 19))
    cmodel = burstc.compile(model, backend="aot_eager", keep_logits=True)
    out = cmodel(input_ids=ids, labels=ids, use_cache=False)
    ref = model(input_ids=ids, labels=ids, use_cache=False)
    torch.testing.assert_close(out.logits, ref.logits)
    torch.testing.assert_close(out.loss, ref.loss)
    out.loss.backward()
    _check_single_rewrite(cmodel)


@pytest.mark.parametrize("attention", ["sdpa", "manual"])
@pytest.mark.parametrize("backend", ["aot_eager", pytest.param("inductor", marks=pytest.mark.slow)])
def test_nanogpt(attention, backend):
    if backend == "inductor" and attention == "manual":
        pytest.skip("one Inductor run of nanoGPT is enough")
    torch.manual_seed(0)
    model = GPT(GPTConfig(block_size=64, vocab_size=301, n_layer=1 if backend == "inductor" else 2,
                          attention=attention))
    x = torch.randint(0, 301, (2, 40))
    y = torch.randint(0, 301, (2, 40))
    y[1, -7:] = -1
    cmodel = burstc.compile(model, backend=backend)
    assert_same_training_step(model, lambda m: m(x, y)[1], lambda: cmodel(x, y)[1])
    _check_single_rewrite(cmodel)
    assert cmodel(x, y)[0] is DROPPED_LOGITS


def test_nanogpt_bf16():
    torch.manual_seed(0)
    model = GPT(GPTConfig(block_size=64, vocab_size=301, n_layer=1)).to(torch.bfloat16)
    x = torch.randint(0, 301, (2, 33))
    y = torch.randint(0, 301, (2, 33))
    cmodel = burstc.compile(model, backend="aot_eager")
    assert_same_training_step(model, lambda m: m(x, y)[1], lambda: cmodel(x, y)[1], dtype=torch.bfloat16)


def test_torchtitan_llama():
    from burstc.testing.zoo import TitanLlama, TitanLlamaArgs, WithLoss

    torch.manual_seed(0)
    model = WithLoss(TitanLlama(TitanLlamaArgs(dim=32, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=173,
                                               max_seq_len=64)))
    tokens = torch.randint(0, 173, (2, 30))
    labels = torch.randint(0, 173, (2, 30))
    cmodel = burstc.compile(model, backend="aot_eager")
    assert_same_training_step(model, lambda m: m(tokens, labels), lambda: cmodel(tokens, labels))
    rep = _check_single_rewrite(cmodel)
    assert rep.rewrites[0].module_path == "model.output"


def test_inference_forward_only():
    """Under no_grad (evaluation) the loss is fused and the logits come back by default, as eager's; the same
    compiled model then trains with the logits dropped (Dynamo guards on grad mode: a second graph)."""
    model = tiny_hf_llama(layers=1)
    ids = torch.randint(0, 211, (2, 16))
    cmodel = burstc.compile(model, backend="aot_eager")
    with torch.no_grad():
        out = cmodel(input_ids=ids, labels=ids, use_cache=False)
        ref = model(input_ids=ids, labels=ids, use_cache=False)
    torch.testing.assert_close(out.loss, ref.loss)
    assert out.logits is not None
    torch.testing.assert_close(out.logits, ref.logits)
    rep = burstc.report(cmodel)
    assert [r.kind for r in rep.rewrites] == ["lm_head_loss"]
    assert rep.rewrites[0].logits.startswith("kept: compiled without gradients")
    assert "backward" not in rep.graphs

    train_out = cmodel(input_ids=ids, labels=ids, use_cache=False)
    assert train_out.logits is DROPPED_LOGITS
    train_out.loss.backward()
    torch.testing.assert_close(train_out.loss, ref.loss)
    rep = burstc.report(cmodel)
    assert [r.logits.split(":")[0] for r in rep.rewrites] == ["kept", "dropped"]
    assert "backward" in rep.graph_records[1].graphs


def test_inference_keep_logits_false_drops_them():
    model = tiny_hf_llama(layers=1)
    ids = torch.randint(0, 211, (1, 12))
    cmodel = burstc.compile(model, backend="aot_eager", keep_logits=False)
    with torch.inference_mode():
        out = cmodel(input_ids=ids, labels=ids, use_cache=False)
        ref = model(input_ids=ids, labels=ids, use_cache=False)
    assert out.logits is DROPPED_LOGITS
    torch.testing.assert_close(out.loss, ref.loss)


class _PerTokenLossLM(torch.nn.Module):
    """A model that takes per-token losses (reduction="none") and averages them over a loss mask itself."""

    def __init__(self, vocab=157, dim=24):
        super().__init__()
        self.embed = torch.nn.Embedding(vocab, dim)
        self.mix = torch.nn.Linear(dim, dim)
        self.head = torch.nn.Linear(dim, vocab, bias=True)

    def forward(self, ids, targets, loss_mask):
        logits = self.head(torch.tanh(self.mix(self.embed(ids))))
        per_token = torch.nn.functional.cross_entropy(logits.view(-1, logits.shape[-1]), targets.view(-1),
                                                      reduction="none").view(targets.shape)
        return (per_token * loss_mask).sum() / loss_mask.sum()


def test_dynamic_shapes_one_graph_for_every_length(recwarn):
    """dynamic=True: one symbolic graph serves every sequence length, with the rewrite in it (token count
    symbolic) and loss and grads equal eager at each length; the rewritten graph carries no raw SymInt."""
    hf_model = tiny_hf_llama(layers=1)
    hf_compiled = burstc.compile(hf_model, backend="aot_eager", dynamic=True)
    torch.manual_seed(1)
    lm = _PerTokenLossLM()
    lm_compiled = burstc.compile(lm, backend="aot_eager", dynamic=True)
    for length in (24, 37, 50):
        ids = torch.randint(0, 211, (2, length))
        labels = ids.clone()
        labels[1, : length // 3] = -100
        run = lambda m: m(input_ids=ids, labels=labels, use_cache=False).loss
        assert_same_training_step(hf_model, run, lambda: hf_compiled(input_ids=ids, labels=labels,
                                                                       use_cache=False).loss)
        tokens = torch.randint(0, 157, (3, length))
        targets = torch.randint(0, 157, (3, length))
        mask = (torch.rand(3, length) < 0.7).float()
        assert_same_training_step(lm, lambda m: m(tokens, targets, mask), lambda: lm_compiled(tokens, targets, mask))
    for compiled in (hf_compiled, lm_compiled):
        rep = burstc.report(compiled)
        assert len(rep.graph_records) == 1, str(rep)  # no recompile per length
        (rewrite,) = rep.rewrites
        assert rewrite.kind == "lm_head_loss" and not isinstance(rewrite.details["tokens"], int), str(rep)
    assert burstc.report(lm_compiled).rewrites[0].details["reduction"] == "none"
    raw_symint = [w for w in recwarn if "Raw SymInt" in str(w.message)]
    assert not raw_symint, raw_symint[0].message
