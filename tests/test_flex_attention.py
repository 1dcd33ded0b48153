"""FlexAttention: the ``mask_mod`` becomes the exact MaskSpec (or a refusal with its code), and a decoder that
builds its block mask in ``forward`` (torchtitan's flex path: causal, sliding window, ``block_causal`` document
ids) trains sharded on CPU ranks with the single-device loss and gradients (torch itself has no CPU
FlexAttention backward: the ring op's replaces it)."""
from __future__ import annotations

import pytest
import torch

from burstc.attention_ir import Alibi, Causal, Documents, MaskSpec, SlidingWindow, SoftCap
from burstc.passes import graph_utils
from burstc.testing import assert_equivalent
from burstc.testing.graphs import detect_attention_in
from burstc.testing.zoo import flex as flex_zoo

flex_module = pytest.importorskip("torch.nn.attention.flex_attention")
create_block_mask, flex_attention = flex_module.create_block_mask, flex_module.flex_attention

B, H, S, D = 2, 2, 48, 8


def _qkv(seq=S):
    g = torch.Generator().manual_seed(0)
    return tuple(torch.randn(B, H, seq, D, generator=g) for _ in range(3))


def _doc_ids(seq=S, per_row=True):
    g = torch.Generator().manual_seed(3)
    rows = torch.stack([torch.cumsum((torch.rand(seq, generator=g) < 0.2).to(torch.int64), 0) for _ in range(B)])
    return rows if per_row else rows[0]


def _detect(mask_mod, *, docs=None, seq=S, **flex_kwargs):
    """detect_attention on ``flex_attention(q, k, v, block_mask(mask_mod))`` -> (the one match, output, eager)."""
    def attention(q, k, v, docs):
        block_mask = create_block_mask(lambda b, h, qi, ki: mask_mod(b, h, qi, ki, docs), B, None, seq, seq,
                                       device="cpu")
        out = flex_attention(q, k, v, block_mask=block_mask, **flex_kwargs)
        return out[0] if isinstance(out, tuple) else out

    inputs = (*_qkv(seq), docs if docs is not None else torch.zeros(1))
    _, context, got = detect_attention_in(attention, *inputs)
    (match,) = context.facts.attention.values()
    return match, context, got, attention(*inputs)


MASKS = {
    "causal": (lambda b, h, q, k, d: q >= k, MaskSpec.causal()),
    "window": (lambda b, h, q, k, d: (q >= k) & (q - k < 5), MaskSpec.causal() & SlidingWindow(4)),
    "band": (lambda b, h, q, k, d: (k - q <= 3) & (q - k <= 2), MaskSpec((SlidingWindow(2, 3),))),
    "full": (lambda b, h, q, k, d: q >= 0, MaskSpec.full()),
}


@pytest.mark.parametrize("name", sorted(MASKS))
def test_static_mask_mod_becomes_its_exact_spec(name):
    mask_mod, expected = MASKS[name]
    match, context, got, want = _detect(mask_mod)
    assert match.mask == expected and match.refusal is None and match.shardable
    assert match.source == "flex" and match.heads_q == H and match.scale == pytest.approx(D ** -0.5)
    torch.testing.assert_close(got, want)


@pytest.mark.parametrize("per_row", [True, False], ids=["ids_BS", "ids_S"])
def test_document_ids_input_becomes_a_runtime_documents_term(per_row):
    docs = _doc_ids(per_row=per_row)
    index = (lambda b, q: docs[b, q]) if per_row else (lambda b, q: docs[q])
    match, _, got, want = _detect(lambda b, h, q, k, d: (q >= k) & (index(b, q) == index(b, k)), docs=docs)
    assert match.refusal is None and match.shardable
    (causal, documents) = match.mask.terms
    assert causal == Causal() and isinstance(documents, Documents) and documents.ids
    torch.testing.assert_close(got, want)


@pytest.mark.parametrize("mask_mod, code", [
    (lambda b, h, q, k, d: (q >= k) & (q // 8 == k // 8), "attention.flex_mask"),       # chunked: no MaskSpec
    (lambda b, h, q, k, d: (q >= k) & (d[b, q] <= d[b, k]), "attention.flex_mask"),      # not an equality of ids
], ids=["chunked", "ids_not_compared_for_equality"])
def test_mask_mod_that_is_no_spec_is_refused(mask_mod, code):
    match, context, got, want = _detect(mask_mod, docs=_doc_ids())
    assert match.refusal is not None and match.refusal.code == code, match.refusal
    assert not match.shardable and code in [s.code for s in context.report.skipped]
    torch.testing.assert_close(got, want)


def test_soft_cap_and_alibi_score_mods_become_score_modifications():
    def soft_cap(score, b, h, q, k):
        return 30.0 * torch.tanh(score / 30.0)

    match, _, got, want = _detect(MASKS["causal"][0], score_mod=soft_cap)
    assert match.refusal is None and match.mask == MaskSpec.causal() & SoftCap(30.0)
    torch.testing.assert_close(got, want)
    def alibi(score, b, h, q, k):  # slopes built in the graph (constants); a tensor from outside is an input
        return score + torch.tensor([0.5, 0.125])[h] * (k - q)

    match, _, got, want = _detect(MASKS["window"][0], score_mod=alibi)
    assert match.refusal is None and match.mask.terms == (Causal(), SlidingWindow(4))
    assert match.mask.term(Alibi).slopes == pytest.approx((0.5, 0.125))
    torch.testing.assert_close(got, want)


@pytest.mark.parametrize("score_mod", [
    lambda score, b, h, q, k: score * 2.0,                              # a temperature: no score modification kind
    lambda score, b, h, q, k: score + (q - k) ** 2 * 0.01,              # a bias not linear in kv - q
    lambda score, b, h, q, k: 30.0 * torch.tanh((score + 1.0) / 30.0),  # a cap of a shifted score
], ids=["scale", "quadratic_bias", "shifted_cap"])
def test_other_score_mods_are_refused(score_mod):
    match, context, got, want = _detect(MASKS["causal"][0], score_mod=score_mod)
    assert match.refusal.code == "attention.flex_score_mod" and not match.shardable
    torch.testing.assert_close(got, want)


def test_returned_lse_is_refused():
    match, _, _, _ = _detect(MASKS["causal"][0], return_lse=True)
    assert match.refusal.code == "attention.flex_outputs"


def test_long_mask_mod_is_classified_at_two_probe_lengths(monkeypatch):
    monkeypatch.setattr(graph_utils, "FULL_EVALUATION_LIMIT", 5000)  # below B * H * 48 * 48
    match, _, _, _ = _detect(MASKS["window"][0])
    assert match.mask == MaskSpec.causal() & SlidingWindow(4)
    docs = _doc_ids()
    match, _, _, _ = _detect(lambda b, h, q, k, d: (q >= k) & (d[b, q] == d[b, k]), docs=docs)
    assert match.refusal is None and match.mask.term(Documents).ids
    # a window of 20 needs probes longer than 2 * 20: none fits under 48 tokens
    match, _, _, _ = _detect(lambda b, h, q, k, d: (q >= k) & (q - k < 20))
    assert match.refusal.code == "attention.flex_mask"


def _detect_computed_ids(compute_ids, tokens, write_after=False):
    """detect_attention on a flex_attention whose mask_mod closes over document ids computed from ``tokens``."""
    def attention(q, k, v, tokens):
        docs = compute_ids(tokens)
        block_mask = create_block_mask(lambda b, h, qi, ki: (qi >= ki) & (docs[b, qi] == docs[b, ki]), B, None, S, S,
                                       device="cpu")
        out = flex_attention(q, k, v, block_mask=block_mask)
        if write_after:
            docs.add_(1)
        return out

    _, context, got = detect_attention_in(attention, *_qkv(), tokens)
    (match,) = context.facts.attention.values()
    return match, got, attention(*_qkv(), tokens)


@pytest.mark.parametrize("case", ["float_input", "written_after"])
def test_document_ids_computed_from_the_inputs_are_refused(case):
    """A mask_mod buffer computed from a float input (an activation), or written in place after the attention
    reads it, is never the Documents source (ids computed from the token inputs alone are: trained below)."""
    tokens = (torch.rand(B, S, generator=torch.Generator().manual_seed(2)) < 0.2).to(torch.int64)
    if case == "float_input":
        match, got, want = _detect_computed_ids(lambda t: (t > 0.5).cumsum(-1), tokens.float())
    else:
        match, got, want = _detect_computed_ids(lambda t: (t == 1).cumsum(-1), tokens, write_after=True)
    torch.testing.assert_close(got, want)
    assert match.refusal.code == "attention.flex_mask" and not match.shardable
    why = {"float_input": "computed from input `l_tokens_`: a value of the activations",
           "written_after": "document ids `docs` are written in place after the attention reads them"}[case]
    assert why in match.refusal.reason, match.refusal.reason


# -- trained sharded on gloo ranks vs the single-device eager model ---------------------------------------------

TRAINED = {
    "causal": (flex_zoo.flex_causal, {"causal (FlexAttention mask_mod)"}),
    "window": (flex_zoo.flex_window, {f"causal&window({flex_zoo.WINDOW - 1},-) (FlexAttention mask_mod)"}),
    "documents": (flex_zoo.flex_documents, {"causal&document_ids(l_doc_ids_) (FlexAttention mask_mod)"}),
    "documents_soft_capped": (flex_zoo.flex_soft_capped,
                              {f"causal&document_ids(l_doc_ids_)&softcap({flex_zoo.SOFT_CAP}) (FlexAttention mask_mod)"}),
    "alibi": (flex_zoo.flex_alibi, None),
}


@pytest.mark.parametrize("name", sorted(TRAINED))
def test_flex_decoder_is_sharded_and_exact(workers, name):
    model_fn, masks = TRAINED[name]
    results = assert_equivalent(model_fn, flex_zoo.flex_inputs, flex_zoo.flex_loss, world_size=2,
                                group=workers.get(2), backend="aot_eager", expect_sharded=True, timeout=600)
    kinds = [k for k, _ in results[0]["rewrites"]]
    assert kinds.count("attention") == flex_zoo.LAYERS and "shard" in kinds
    if masks is None:  # ALiBi: the model's slopes
        assert all(m.startswith("causal&alibi(0.5,0.25,0.125,0.0625)") for m in results[0]["attention_masks"])
    else:
        assert set(results[0]["attention_masks"]) == masks, results[0]["attention_masks"]


def test_flex_documents_on_four_ranks_striped(workers):
    results = assert_equivalent(flex_zoo.flex_documents, flex_zoo.flex_inputs, flex_zoo.flex_loss, world_size=4,
                                group=workers.get(4), backend="aot_eager", expect_sharded=True, timeout=600,
                                layout="striped", attention_plan="kv_ring")
    assert [k for k, _ in results[0]["rewrites"]].count("attention") == flex_zoo.LAYERS


# -- document ids the model computes itself (torchtitan: from the EOS tokens) -----------------------------------

EOS_MASK = "causal&document_ids(seq_idx) (FlexAttention mask_mod)"


@pytest.mark.parametrize("world_size", [2, pytest.param(3, marks=pytest.mark.slow)])
def test_document_ids_computed_in_forward_are_sharded(workers, world_size):
    """torchtitan computes its document ids inside forward from the EOS tokens (in-place writes included): a
    value of the replicated token inputs, so it is the Documents source as an input of ids is; layout "auto"
    picks the documents layout for it (on 3 ranks the 32 tokens are padded)."""
    results = assert_equivalent(flex_zoo.flex_eos_documents, flex_zoo.flex_eos_inputs, flex_zoo.flex_loss,
                                world_size=world_size, group=workers.get(world_size), backend="aot_eager",
                                expect_sharded=True, timeout=600)
    assert results[0]["attention_masks"] == [EOS_MASK] * flex_zoo.LAYERS, results[0]["attention_masks"]
    assert results[0]["shard_details"]["layout"] == "documents", results[0]["shard_details"]
    assert (results[0]["padded_to"] is not None) == (world_size == 3), results[0]["shard_details"]


def test_document_ids_computed_after_the_first_sharded_op(workers):
    """Ids computed after the embedding already read sharded tokens: the documents layout can't assign the chunks
    before that op, so the graph takes zigzag (reason reported), still sharded and exact."""
    results = assert_equivalent(flex_zoo.flex_eos_documents_late, flex_zoo.flex_eos_inputs, flex_zoo.flex_loss,
                                world_size=2, group=workers.get(2), backend="aot_eager", expect_sharded=True,
                                timeout=600)
    assert results[0]["attention_masks"] == [EOS_MASK] * flex_zoo.LAYERS, results[0]["attention_masks"]
    details = results[0]["shard_details"]
    assert details["layout"] == "zigzag" and "document ids `seq_idx` are computed after" in details["layout_reason"], \
        details


def test_mask_mod_reading_activations_is_refused(workers):
    """Ids derived from the hidden states are sharded activations, never document ids: refused with the reason,
    the graph runs replicated (exact)."""
    results = assert_equivalent(flex_zoo.flex_hidden_documents, flex_zoo.flex_eos_inputs, flex_zoo.flex_loss,
                                world_size=2, group=workers.get(2), backend="aot_eager", expect_sharded=False,
                                timeout=600)
    assert "shard" not in [k for k, _ in results[0]["rewrites"]]
    assert "attention.flex_mask" in results[0]["skip_codes"], results[0]["skipped"]
    reasons = [reason for _, reason in results[0]["skipped"]]
    assert any("computed from parameter" in r and "not of the token inputs alone" in r for r in reasons), reasons
