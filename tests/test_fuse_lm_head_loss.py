"""The LM-head + cross-entropy fusion pass: what it rewrites, what it refuses, and that the
rewritten graph computes the same loss and gradients as eager."""

import operator

import pytest
import torch
import torch.nn.functional as F

import burstc
from burstc.passes.fuse_lm_head_loss import CODES
from burstc.guards import DROPPED_LOGITS
from burstc.ops.linear_cross_entropy import linear_cross_entropy
from burstc.testing import assert_same_training_step

V, H = 53, 12


class Head(torch.nn.Module):
    """An embedding + LM head whose forward is the pattern under test, ``loss_fn(self, hidden, labels)``."""

    def __init__(self, loss_fn, bias=False):
        super().__init__()
        self.emb = torch.nn.Embedding(V, H)
        self.lm_head = torch.nn.Linear(H, V, bias=bias)
        self.loss_fn = loss_fn

    def forward(self, ids, labels):
        return self.loss_fn(self, torch.tanh(self.emb(ids)), labels)


def nanogpt_style(m, h, y):
    logits = m.lm_head(h)
    return F.cross_entropy(logits.view(-1, logits.size(-1)), y.view(-1), ignore_index=-1)


def torchtitan_style(m, h, y):
    return F.cross_entropy(m.lm_head(h).flatten(0, 1).float(), y.flatten(0, 1))


def hf_style(m, h, y):
    # transformers 5.x ForCausalLMLoss: upcast, pad-and-shift the labels, flatten
    logits = m.lm_head(h[:, slice(0, None), :]).float()
    labels = F.pad(y, (0, 1), value=-100)
    shift = labels[..., 1:].contiguous()
    return F.cross_entropy(logits.view(-1, V), shift.view(-1).to(logits.device), ignore_index=-100, reduction="mean")


def hf_num_items_style(m, h, y):
    logits = m.lm_head(h).float()
    loss = F.cross_entropy(logits.view(-1, V), y.view(-1), ignore_index=-100, reduction="sum")
    return loss / (y != -100).sum()


def old_hf_shifted_logits(m, h, y):
    logits = m.lm_head(h)
    shift_logits = logits[..., :-1, :].contiguous()
    shift_labels = y[..., 1:].contiguous()
    return F.cross_entropy(shift_logits.view(-1, V), shift_labels.view(-1))


def sum_reduction(m, h, y):
    return F.cross_entropy(m.lm_head(h).reshape(-1, V), y.reshape(-1), reduction="sum")


def none_reduction(m, h, y):
    per_token = F.cross_entropy(m.lm_head(h).reshape(-1, V), y.reshape(-1), reduction="none")
    return (per_token * torch.linspace(0.5, 1.5, per_token.numel())).sum()


def label_smoothing(m, h, y):
    return F.cross_entropy(m.lm_head(h).view(-1, V).float(), y.view(-1), label_smoothing=0.1)


def softcapped(m, h, y):
    # Gemma-2 style final-logit soft-capping
    logits = m.lm_head(h)
    logits = logits / 30.0
    logits = torch.tanh(logits)
    logits = logits * 30.0
    return F.cross_entropy(logits.float().view(-1, V), y.view(-1))


def cohere_scaled(m, h, y):
    # Cohere: logits = lm_head(h) * logit_scale, then the HF loss upcasts
    return F.cross_entropy((m.lm_head(h) * 0.0625).float().view(-1, V), y.view(-1))


def granite_divided(m, h, y):
    # Granite: logits = lm_head(h) / logits_scaling, then soft-capped here too
    logits = 3.0 * torch.tanh((m.lm_head(h) / 8.0) / 3.0)
    return F.cross_entropy(logits.float().view(-1, V), y.view(-1))


def divided_by_three(m, h, y):
    # a divisor without an exact reciprocal: the op divides, as the model does
    return F.cross_entropy((m.lm_head(h) / 3.0).view(-1, V), y.view(-1))


def classes_in_dim_one(m, h, y):
    # CE's [B, classes, S] layout: the [B, S, V] logits transposed, targets [B, S]
    return F.cross_entropy(m.lm_head(h).transpose(1, 2), y)


def classes_in_dim_one_permuted_none(m, h, y):
    per_token_BS = F.cross_entropy(m.lm_head(h).float().permute(0, 2, 1), y, reduction="none")
    return (per_token_BS * torch.arange(per_token_BS.shape[1])).sum()


def negative_softcap(m, h, y):
    # -c * tanh(x / -c) is the c = 5 soft-cap (tanh is odd)
    return F.cross_entropy((torch.tanh(m.lm_head(h) / -5.0) * -5.0).view(-1, V), y.view(-1))


def nll_of_log_softmax(m, h, y):
    # cross_entropy spelled out, as older code writes it
    return F.nll_loss(F.log_softmax(m.lm_head(h).view(-1, V), dim=-1), y.view(-1))


def nll_upcast_log_softmax_then_view(m, h, y):
    log_probs = torch.log_softmax(m.lm_head(h).float(), -1).view(-1, V)
    return F.nll_loss(log_probs, y.view(-1), reduction="sum")


def nll_method_log_softmax_none(m, h, y):
    per_token = F.nll_loss(m.lm_head(h).log_softmax(dim=-1).flatten(0, 1), y.flatten(0, 1), reduction="none")
    return (per_token * torch.linspace(0.0, 1.0, per_token.numel())).sum()


REWRITTEN = {
    "negative_softcap": (negative_softcap, False),
    "classes_in_dim_one": (classes_in_dim_one, False),
    "classes_in_dim_one_permuted_none": (classes_in_dim_one_permuted_none, True),
    "nll_log_softmax": (nll_of_log_softmax, True),
    "nll_upcast_log_softmax_view": (nll_upcast_log_softmax_then_view, False),
    "nll_method_log_softmax_none": (nll_method_log_softmax_none, False),
    "cohere_scale": (cohere_scaled, True),
    "granite_divisor_softcap": (granite_divided, False),
    "divided_by_three": (divided_by_three, True),
    "nanogpt": (nanogpt_style, False),
    "torchtitan": (torchtitan_style, False),
    "hf": (hf_style, False),
    "hf_num_items": (hf_num_items_style, False),
    "old_hf_shifted_logits": (old_hf_shifted_logits, False),
    "bias": (nanogpt_style, True),
    "sum": (sum_reduction, False),
    "none": (none_reduction, False),
    "label_smoothing": (label_smoothing, False),
    "softcap": (softcapped, False),
}


def _labels(shape, ignore_fraction=0.25, ignore_index=-100, seed=0):
    g = torch.Generator().manual_seed(seed)
    y = torch.randint(0, V, shape, generator=g)
    y[torch.rand(shape, generator=g) < ignore_fraction] = ignore_index
    return y


@pytest.mark.parametrize("name", sorted(REWRITTEN))
def test_pattern_is_rewritten_once_and_matches_eager(name):
    loss_fn, bias = REWRITTEN[name]
    torch.manual_seed(0)
    model = Head(loss_fn, bias=bias)
    ids = torch.randint(0, V, (3, 7))
    labels = _labels((3, 7), ignore_index=-1 if name in ("nanogpt", "bias") else -100)
    cmodel = burstc.compile(model, backend="aot_eager")
    assert_same_training_step(model, lambda m: m(ids, labels), lambda: cmodel(ids, labels))
    rep = burstc.report(cmodel)
    assert [r.kind for r in rep.rewrites] == ["lm_head_loss"], str(rep)
    assert rep.rewrites[0].module_path == "lm_head"
    rewritten = rep.graphs["rewritten"]
    assert sum(n.target in (F.cross_entropy, F.nll_loss) for n in rewritten.graph.nodes) == 0
    assert not any(n.target in (torch._C._nn.linear,) and n.args[1].name.endswith("lm_head_parameters_weight_")
                   for n in rewritten.graph.nodes if n.op == "call_function"), "the LM-head matmul should be gone"


def test_logit_scale_is_in_the_details():
    model = Head(cohere_scaled)
    cmodel = burstc.compile(model, backend="aot_eager")
    ids = torch.randint(0, V, (2, 9))
    cmodel(ids, ids)
    assert burstc.report(cmodel).rewrites[0].logit_scale == 0.0625
    assert burstc.report(cmodel).rewrites[0].logit_divisor is None


def test_logit_divisor_is_in_the_details():
    model = Head(divided_by_three)
    cmodel = burstc.compile(model, backend="aot_eager")
    ids = torch.randint(0, V, (2, 9))
    cmodel(ids, ids)
    record = burstc.report(cmodel).rewrites[0]
    assert (record.logit_scale, record.logit_divisor) == (None, 3.0)
    fused = [n for n in burstc.report(cmodel).graphs["rewritten"].graph.nodes if n.op == "call_function"
             and n.kwargs.get("logit_divisor") is not None]
    assert len(fused) == 1 and fused[0].kwargs["logit_divisor"] == 3.0 and "logit_scale" not in fused[0].kwargs


def test_details_of_rewrite():
    model = Head(label_smoothing)
    cmodel = burstc.compile(model, backend="aot_eager", lm_head_chunk_size=5)
    ids = torch.randint(0, V, (2, 9))
    cmodel(ids, ids)
    record = burstc.report(cmodel).rewrites[0]
    assert record.tokens == 18 and record.vocab == V and record.hidden == H
    assert record.chunk_size == 5 and record.label_smoothing == pytest.approx(0.1)
    assert record.predicted_peak_bytes["fused"] > 0


def _returns_logits(m, h, y):
    logits = m.lm_head(h)
    loss = F.cross_entropy(logits.view(-1, V), y.view(-1))
    return loss, logits


class ReturnsLogits(Head):
    def forward(self, ids, labels):
        return _returns_logits(self, torch.tanh(self.emb(ids)), labels)


def test_logits_only_returned_become_a_stand_in_by_default():
    model = ReturnsLogits(None)
    ids = torch.randint(0, V, (2, 6))
    cmodel = burstc.compile(model, backend="aot_eager")
    loss, logits = cmodel(ids, ids)
    assert logits is DROPPED_LOGITS
    ref_loss, _ = model(ids, ids)
    torch.testing.assert_close(loss, ref_loss)
    rep = burstc.report(cmodel)
    assert "returned as a stand-in" in rep.rewrites[0].logits
    assert rep.graph_records[0].dropped_outputs == (1,)


class ReturnsTransformedLogits(Head):
    """Gemma-2 / Cohere return the soft-capped / scaled logits, HF's loss upcasts them."""

    def __init__(self, transform):
        super().__init__(None)
        self.transform = transform

    def forward(self, ids, labels):
        logits = self.transform(self.lm_head(torch.tanh(self.emb(ids))))
        return F.cross_entropy(logits.float().view(-1, V), labels.view(-1)), logits


TRANSFORMS = {
    "softcap": lambda x: torch.tanh(x / 30.0) * 30.0,
    "scale": lambda x: x * 0.0625,
    "upcast": lambda x: x.float(),
}


@pytest.mark.parametrize("transform", sorted(TRANSFORMS))
def test_transformed_logits_only_returned_are_dropped_too(transform):
    model = ReturnsTransformedLogits(TRANSFORMS[transform])
    ids = torch.randint(0, V, (2, 6))
    cmodel = burstc.compile(model, backend="aot_eager")
    loss, logits = cmodel(ids, ids)
    assert logits is DROPPED_LOGITS
    torch.testing.assert_close(loss, model(ids, ids)[0])
    rep = burstc.report(cmodel)
    assert "returned as a stand-in" in rep.rewrites[0].logits, rep.rewrites[0].logits
    forward = rep.graphs["forward"]
    assert not any(n.target in (torch.ops.aten.mm.default, torch.ops.aten.addmm.default)
                   for n in forward.graph.nodes), "the [tokens, vocab] logits are still computed"
    with torch.no_grad():  # evaluation keeps them, transformed as the model returns them
        _, kept = burstc.compile(model, backend="aot_eager")(ids, ids)
    torch.testing.assert_close(kept, model(ids, ids)[1])


def test_keep_logits_keeps_them():
    model = ReturnsLogits(None)
    ids = torch.randint(0, V, (2, 6))
    cmodel = burstc.compile(model, backend="aot_eager", keep_logits=True)
    loss, logits = cmodel(ids, ids)
    ref_loss, ref_logits = model(ids, ids)
    torch.testing.assert_close(logits, ref_logits)
    torch.testing.assert_close(loss, ref_loss)
    assert burstc.report(cmodel).rewrites[0].logits == "kept: keep_logits=True"


def _logits_used_elsewhere(m, h, y):
    logits = m.lm_head(h)
    loss = F.cross_entropy(logits.view(-1, V), y.view(-1))
    return loss + 0.01 * logits.logsumexp(-1).mean()


def test_logits_used_by_other_ops_are_kept_and_reported():
    torch.manual_seed(0)
    model = Head(_logits_used_elsewhere)
    ids = torch.randint(0, V, (2, 6))
    cmodel = burstc.compile(model, backend="aot_eager")
    assert_same_training_step(model, lambda m: m(ids, ids), lambda: cmodel(ids, ids))
    record = burstc.report(cmodel).rewrites[0]
    assert record.logits.startswith("kept: used by")


def class_weights(m, h, y):
    return F.cross_entropy(m.lm_head(h).view(-1, V), y.view(-1), weight=torch.linspace(0.5, 1.5, V))


def scaled_after_upcast(m, h, y):
    return F.cross_entropy((m.lm_head(h).float() * 0.5).view(-1, V), y.view(-1))


def scaled_by_tensor(m, h, y):
    return F.cross_entropy((m.lm_head(h) * h.new_tensor(0.5)).view(-1, V), y.view(-1))


def sequence_as_classes(m, h, y):
    # [B, S, V] straight into CE: dim 1 (S) is the class dim, the targets index positions: not an LM loss
    positions_BV = (torch.arange(V) % h.shape[1]).expand(h.shape[0], V)
    return F.cross_entropy(m.lm_head(h), positions_BV)


def float64_upcast(m, h, y):
    return F.cross_entropy(m.lm_head(h).double().view(-1, V), y.view(-1)).float()


def matmul_head(m, h, y):
    return F.cross_entropy((h @ m.lm_head.weight.t()).view(-1, V), y.view(-1))


def reshape_vocab(m, h, y):
    logits = m.lm_head(h)
    return F.cross_entropy(logits.reshape(-1, V // 1).reshape(-1, 1, V).squeeze(1)[:, : V - 3], y.view(-1) % (V - 3))


def log_probs_used_elsewhere(m, h, y):
    log_probs = F.log_softmax(m.lm_head(h).view(-1, V), dim=-1)
    return F.nll_loss(log_probs, y.view(-1)) - 1e-3 * log_probs.mean()


def log_softmax_over_tokens(m, h, y):
    return F.nll_loss(F.log_softmax(m.lm_head(h).view(-1, V), dim=0), y.view(-1))


def nll_class_weights(m, h, y):
    return F.nll_loss(F.log_softmax(m.lm_head(h).view(-1, V), -1), y.view(-1), weight=torch.linspace(0.5, 1.5, V))


def nll_without_log_softmax(m, h, y):
    return F.nll_loss(m.lm_head(h).view(-1, V), y.view(-1))


def slice_after_flatten(m, h, y):
    # a slice of the flattened tokens: on the [B, S, H] hidden states it would index the batch
    logits = m.lm_head(h).view(-1, V)
    return F.cross_entropy(logits[::2], y.view(-1)[::2])


def shift_after_unflatten(m, h, y):
    b, s, _ = h.shape
    logits = m.lm_head(h.reshape(-1, H)).view(b, s, V)[:, :-1]
    return F.cross_entropy(logits.reshape(-1, V), y[:, 1:].reshape(-1))


def cast_like_a_bf16_tensor(m, h, y):
    return F.cross_entropy(m.lm_head(h).to(torch.zeros((), dtype=torch.bfloat16)).view(-1, V), y.view(-1))


REFUSED = {
    "slice_after_flatten": (slice_after_flatten, CODES.token_indexing),
    "shift_after_unflatten": (shift_after_unflatten, CODES.token_indexing),
    "cast_like_a_bf16_tensor": (cast_like_a_bf16_tensor, CODES.device_or_dtype),
    "log_probs_used_elsewhere": (log_probs_used_elsewhere, CODES.log_softmax),
    "log_softmax_over_tokens": (log_softmax_over_tokens, CODES.log_softmax),
    "nll_class_weights": (nll_class_weights, CODES.loss_arguments),
    "nll_without_log_softmax": (nll_without_log_softmax, CODES.log_softmax),
    "class_weights": (class_weights, CODES.loss_arguments),
    "scaled_after_upcast": (scaled_after_upcast, CODES.logit_scale),
    "scaled_by_tensor": (scaled_by_tensor, CODES.unsupported_op),
    "sequence_as_classes": (sequence_as_classes, CODES.loss_shape),
    "float64_upcast": (float64_upcast, CODES.unsupported_op),
    "matmul_head": (matmul_head, CODES.unsupported_op),
    "reshape_vocab": (reshape_vocab, CODES.token_indexing),
}


@pytest.mark.parametrize("name", sorted(REFUSED))
def test_pattern_not_rewritten_is_skipped_with_code(name):
    loss_fn, code = REFUSED[name]
    torch.manual_seed(0)
    model = Head(loss_fn)
    ids = torch.randint(0, V, (2, 5))
    cmodel = burstc.compile(model, backend="aot_eager")
    torch.testing.assert_close(cmodel(ids, ids), model(ids, ids))
    rep = burstc.report(cmodel)
    assert rep.rewrites == [], str(rep)
    assert len(rep.skipped) == 1 and rep.skipped[0].kind == "lm_head_loss"
    assert rep.skipped[0].code == code and rep.skipped[0].reason, rep.skipped[0]


def test_no_loss_in_graph_means_no_candidates():
    class LogitsOnly(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.lm_head = torch.nn.Linear(H, V)

        def forward(self, h):
            return self.lm_head(h)

    cmodel = burstc.compile(LogitsOnly(), backend="aot_eager")
    cmodel(torch.randn(2, H))
    rep = burstc.report(cmodel)
    assert rep.rewrites == [] and rep.skipped == [] and rep.pass_run("fuse_lm_head_loss").note == "found no candidates"


def test_bf16_model_loss_is_fp32_and_close_to_eager():
    torch.manual_seed(0)
    model = Head(hf_style).to(torch.bfloat16)
    ids = torch.randint(0, V, (4, 16))
    cmodel = burstc.compile(model, backend="aot_eager")
    loss, ref = assert_same_training_step(model, lambda m: m(ids, ids), lambda: cmodel(ids, ids), dtype=torch.bfloat16)
    assert loss.dtype == torch.float32


def test_all_ignored_mean_is_nan_like_eager():
    model = Head(torchtitan_style)
    ids = torch.randint(0, V, (2, 4))
    labels = torch.full((2, 4), -100)
    cmodel = burstc.compile(model, backend="aot_eager")
    loss = cmodel(ids, labels)
    assert torch.isnan(loss) and torch.isnan(model(ids, labels))


def _front_shifted(m, h, y):  # the mirror image: position t predicts label t - 1
    logits = m.lm_head(h)
    return F.cross_entropy(logits[:, 1:].reshape(-1, V), y[:, :-1].reshape(-1), reduction="sum")


def _shifted_none(m, h, y):
    logits = m.lm_head(h)
    return F.cross_entropy(logits[..., :-1, :].reshape(-1, V), y[..., 1:].reshape(-1), reduction="none").sum()


@pytest.mark.parametrize("loss_fn, sliced", [
    (old_hf_shifted_logits, "dim 1: 0 before, 1 after, as ignored targets"),
    (_front_shifted, "dim 1: 1 before, 0 after, as ignored targets"),
    (_shifted_none, None),  # per-token losses have the sliced shape: the slice stays on the hidden states
])
def test_shifted_logits_become_ignored_targets_on_the_whole_sequence(loss_fn, sliced):
    """HF 4.x's ``logits[..., :-1, :]`` against ``labels[..., 1:]``: the hidden states stay whole (the shard pass
    can't split a slice of the sequence) and the cut positions get ``ignore_index`` targets, the same mean or sum;
    with reduction='none' the slice stays."""
    torch.manual_seed(0)
    model = Head(loss_fn)
    ids, labels = torch.randint(0, V, (3, 7)), _labels((3, 7))
    cmodel = burstc.compile(model, backend="aot_eager")
    assert_same_training_step(model, lambda m: m(ids, labels), lambda: cmodel(ids, labels))
    record = burstc.report(cmodel).rewrites_of("lm_head_loss")[0]
    assert record.sliced_tokens == sliced
    assert record.tokens == 3 * (7 if sliced else 6)  # the rows the op runs: the whole sequence when shifted
    nodes = list(burstc.report(cmodel).graphs["rewritten"].graph.nodes)
    pads = [n for n in nodes if n.target is F.pad]
    hidden_slices = [n for n in nodes if n.op == "call_function" and n.target is operator.getitem
                     and any(u.target is linear_cross_entropy for u in n.users)]
    if sliced:
        assert len(pads) == 1 and pads[0].kwargs["value"] == -100 and not hidden_slices
    else:
        assert not pads and len(hidden_slices) == 1
