"""Masks too long to evaluate at the traced length (a [B, 1, S, S] mask at S = 64K is 4G entries) are classified
at two shorter probe lengths: the same spec as at the traced length, or a refusal with a code — never a spec
that only holds at the probe lengths (one process; the limit is lowered so that short inputs take that path)."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from burstc.attention_ir import Causal, Documents, KeyPadding, MaskSpec, SlidingWindow
from burstc.passes import graph_utils, mask_classification
from burstc.testing.graphs import detect_attention_in

B, H, S, D = 1, 2, 64, 8


@pytest.fixture
def probed_lengths(monkeypatch):
    """Lowers the compile-time evaluation limit below a [1, 1, 64, 64] mask and records every length the masks
    are evaluated at (None: the traced length)."""
    monkeypatch.setattr(graph_utils, "FULL_EVALUATION_LIMIT", 4000)
    seen = []
    real = mask_classification.evaluate_constant

    def spy(*args, length=None, **kwargs):
        seen.append(None if length is None else length.probe)
        return real(*args, length=length, **kwargs)

    monkeypatch.setattr(mask_classification, "evaluate_constant", spy)
    return seen


def _positions(seq=S):
    i = torch.arange(seq)
    return i[:, None], i[None, :]


def _qkv(seq=S):
    g = torch.Generator().manual_seed(0)
    return tuple(torch.randn(B, H, seq, D, generator=g) for _ in range(3))


def _window(w):
    i, j = _positions()
    return (j <= i) & (j > i - w)


def _match(fn, *inputs):
    _, context, got = detect_attention_in(fn, *inputs)
    matches = list(context.facts.attention.values())
    return matches, context, got


@pytest.mark.parametrize("build, expected", [
    (lambda: _window(4), MaskSpec.causal() & SlidingWindow(3)),
    (lambda: _window(20), MaskSpec.causal() & SlidingWindow(19)),   # probes longer than twice the window
    (lambda: _window(S), MaskSpec.causal()),                         # the length itself: a causal mask at any length
    (lambda: torch.ones(S, S, dtype=torch.bool).tril(diagonal=0), MaskSpec.causal()),
    (lambda: torch.where(_window(S), 0.0, torch.finfo(torch.float32).min), MaskSpec.causal()),
    (lambda: (_positions()[1] >= _positions()[0] - 2) & (_positions()[1] <= _positions()[0] + 3),
     MaskSpec((SlidingWindow(2, 3),))),
], ids=["window4", "window20", "window_is_length", "tril", "finfo_min_additive", "band"])
def test_long_constant_mask_is_classified_at_two_shorter_lengths(probed_lengths, build, expected):
    (match,), _, got = _match(lambda q, k, v: F.scaled_dot_product_attention(q, k, v, attn_mask=build()), *_qkv())
    assert match.mask == expected and match.refusal is None
    probes = set(probed_lengths)
    assert None not in probes and len(probes) == 2 and all(p < S for p in probes), probed_lengths
    q, k, v = _qkv()
    torch.testing.assert_close(got, F.scaled_dot_product_attention(q, k, v, attn_mask=build()))


@pytest.mark.parametrize("build, code", [
    # a threshold of S // 2 needs probes longer than S: can't be shortened
    (lambda: _window(S // 2), "attention.mask_too_long"),
    # a window of S - 1 follows the length when it is substituted: the two probes disagree
    (lambda: _window(S - 1), "attention.mask_length_dependent"),
    # the mask's size derives from S * S: the shapes don't follow the substitution
    (lambda: (torch.arange(S * S).view(S, S) % (S + 1) == 0) | _window(1), "attention.mask_too_long"),
], ids=["half_length_window", "length_minus_one_window", "flattened"])
def test_mask_tied_to_the_length_is_refused_not_guessed(probed_lengths, build, code):
    (match,), context, got = _match(lambda q, k, v: F.scaled_dot_product_attention(q, k, v, attn_mask=build()),
                                    *_qkv())
    assert match.refusal is not None and match.refusal.code == code, match.refusal
    assert not match.shardable
    q, k, v = _qkv()
    torch.testing.assert_close(got, F.scaled_dot_product_attention(q, k, v, attn_mask=build()))


def test_refusal_without_lowered_limit_is_exact_spec():
    # the same S - 1 window at the traced length is a plain window: the refusal above comes from the length
    (match,), _, _ = _match(lambda q, k, v: F.scaled_dot_product_attention(q, k, v, attn_mask=_window(S - 1)),
                            *_qkv())
    assert match.mask == MaskSpec.causal() & SlidingWindow(S - 2)


# -- HF models: constant (eager) and runtime (packed, padded) masks, at the probe lengths -------------------------

HF_S = 96


def _hf(config_name, impl, **overrides):
    pytest.importorskip("transformers")
    from burstc.testing.zoo import hf_arch_variant

    return hf_arch_variant(config_name, impl, **overrides)


def _packed_positions(batch, seq):
    from burstc.testing.zoo import packed_position_ids

    return packed_position_ids(batch, seq, lengths=(17, 1, 30))


def _right_padded(batch, seq):
    mask = torch.ones(batch, seq, dtype=torch.int64)
    mask[0, seq - 11:] = 0
    return mask


HF_CASES = {
    "llama_eager": ("LlamaConfig", "eager", {}, 1, None, MaskSpec.causal()),
    "mistral_window_eager": ("MistralConfig", "eager", {"sliding_window": 8}, 1, None,
                             MaskSpec.causal() & SlidingWindow(7)),
    "llama_sdpa_packed": ("LlamaConfig", "sdpa", {}, 1, "position_ids",
                          MaskSpec.causal() & Documents("position_ids")),
    "llama_eager_padded": ("LlamaConfig", "eager", {}, 2, "attention_mask",
                           MaskSpec.causal() & KeyPadding("attention_mask")),
    "mistral_window_sdpa_packed": ("MistralConfig", "sdpa", {"sliding_window": 8}, 1, "position_ids",
                                   MaskSpec.causal() & SlidingWindow(7) & Documents("position_ids")),
}


@pytest.mark.parametrize("case", sorted(HF_CASES))
def test_hf_masks_at_probe_lengths(probed_lengths, case):
    config_name, impl, overrides, batch, runtime_input, expected = HF_CASES[case]
    model = _hf(config_name, impl, **overrides)
    ids = torch.randint(0, model.config.vocab_size, (batch, HF_S), generator=torch.Generator().manual_seed(1))
    extra = {"position_ids": _packed_positions, "attention_mask": _right_padded}[runtime_input](batch, HF_S) \
        if runtime_input else None

    def logits(ids, extra):
        kwargs = {runtime_input: extra} if runtime_input else {}
        return model(input_ids=ids, use_cache=False, **kwargs).logits

    matches, _, got = _match(logits, ids, extra)
    assert len(matches) == model.config.num_hidden_layers
    # runtime terms are named after the graph's placeholder for the input
    assert {m.mask.static_part for m in matches} == {expected.static_part}, [str(m.mask) for m in matches]
    assert all(type(t) in {type(u) for u in expected.terms} for m in matches for t in m.mask.terms)
    assert all(m.refusal is None and m.shardable for m in matches)
    probes = set(probed_lengths)
    assert None not in probes and len(probes) == 2 and max(probes) < HF_S, probed_lengths
    torch.testing.assert_close(got, logits(ids, extra))


def test_hf_packed_mask_at_64k_tokens_is_recognized_without_evaluating_it():
    """The real limit: HF Llama (sdpa) with packed documents at S = 64K is recognized as causal & documents (a
    full evaluation would need a 4G-entry mask); captured with fake tensors, nothing runs at that length."""
    model = _hf("LlamaConfig", "sdpa")
    seq = 65536
    ids = torch.zeros(1, seq, dtype=torch.int64)
    positions = _packed_positions(1, seq)
    _, context, _ = detect_attention_in(
        lambda ids, p: model(input_ids=ids, position_ids=p, use_cache=False).logits, ids, positions, run=False)
    matches = list(context.facts.attention.values())
    assert len(matches) == model.config.num_hidden_layers
    assert all(m.mask.terms[0] == Causal() and isinstance(m.mask.terms[1], Documents) and len(m.mask.terms) == 2
               for m in matches), [str(m.mask) for m in matches]
