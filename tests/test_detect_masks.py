"""detect_attention turns every static mask into the exact MaskSpec, or refuses with a code (one process).

Each case captures a Dynamo graph and runs the pass inside the backend (where buffer values are still
held); where the pass rewrites the graph, the rewritten graph must compute what the function does."""
import functools
import operator

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from burstc.attention_ir import Alibi, Causal, KeyPadding, MaskSpec, SlidingWindow, SoftCap

B, H, S, D = 1, 2, 12, 8
SDPA = F.scaled_dot_product_attention
MIN = torch.finfo(torch.float32).min


def _detect(fn, *inputs):
    """-> (context, rewritten graph's output, fn's output): the pass runs inside the backend."""
    from burstc.testing.graphs import detect_attention_in

    expected = fn(*inputs)
    _, context, got = detect_attention_in(fn, *inputs)
    return context, got, expected


def _qkv(heads=H, seed=0):
    g = torch.Generator().manual_seed(seed)
    return tuple(torch.randn(B, heads, S, D, generator=g) for _ in range(3))


def _positions():
    i = torch.arange(S)
    return i[:, None], i[None, :]  # query i, key j


def _one_match(context):
    (match,) = context.facts.attention.values()
    return match


def _codes(context):
    return [s.code for s in context.report.skipped]


# -- constant visibility masks ---------------------------------------------------------------------------------


def window_mask(w):          # HF's sliding window: the query and the w - 1 keys before it
    i, j = _positions()
    return (j <= i) & (j > i - w)


def band_mask(left, right):
    i, j = _positions()
    return (j >= i - left) & (j <= i + right)


def chunked_mask(chunk):     # Llama-4 style: causal inside equal chunks
    i, j = _positions()
    return (j <= i) & (i // chunk == j // chunk)


@pytest.mark.parametrize("build, expected", [
    (lambda: window_mask(4), MaskSpec.causal() & SlidingWindow(3)),
    (lambda: window_mask(S), MaskSpec.causal()),                  # window as long as the sequence
    (lambda: band_mask(2, 3), MaskSpec((SlidingWindow(2, 3),))),
    (lambda: band_mask(0, S), MaskSpec((SlidingWindow(0, None),))),
    (lambda: torch.ones(S, S, dtype=torch.bool).tril(), MaskSpec.causal()),
    (lambda: torch.ones(1, H, S, S, dtype=torch.bool), MaskSpec.full()),
], ids=["causal_window", "window_ge_seq", "band", "anti_causal", "causal", "full"])
def test_constant_bool_mask_becomes_its_exact_spec(build, expected):
    def attention(q, k, v):
        return SDPA(q, k, v, attn_mask=build())

    context, got, want = _detect(attention, *_qkv())
    match = _one_match(context)
    assert match.mask == expected and match.refusal is None
    assert match.shardable == expected.ring_supported
    i = torch.arange(S)
    assert torch.equal(expected.visible(i, i), build().reshape(-1, S, S)[0])
    # full/causal fold into is_causal; other specs keep the mask on the node (exact if the shard pass refuses)
    folds = expected.is_full or expected.is_causal
    assert (match.node.kwargs.get("attn_mask") is None) == folds
    assert len(context.report.rewrites) == int(folds)  # a kept mask is no rewrite
    torch.testing.assert_close(got, want)


def test_windowed_mask_broadcast_over_batch_and_heads():
    def attention(q, k, v):
        return SDPA(q, k, v, attn_mask=window_mask(5).expand(B, H, S, S))

    context, got, want = _detect(attention, *_qkv())
    assert _one_match(context).mask == MaskSpec((Causal(), SlidingWindow(4)))
    torch.testing.assert_close(got, want)


def _flipped_window():
    mask = window_mask(4).clone()
    mask[7, 1] = True  # one key too far back
    return mask


def _heads_differ():
    return torch.stack([window_mask(4), window_mask(5)])[None]


@pytest.mark.parametrize("build", [_flipped_window, lambda: chunked_mask(4), _heads_differ,
                                   lambda: torch.zeros(S, S, dtype=torch.bool)],
                         ids=["band_one_wrong_entry", "chunked", "heads_differ", "nothing_visible"])
def test_near_miss_masks_are_refused_as_dense(build):
    def attention(q, k, v):
        return SDPA(q, k, v, attn_mask=build())

    context, got, want = _detect(attention, *_qkv())
    match = _one_match(context)
    assert match.refusal.code == "attention.mask_dense" and not match.shardable
    assert match.node.kwargs.get("attn_mask", None) is not None or len(match.node.args) > 3  # left in place
    torch.testing.assert_close(got, want, equal_nan=True)


# -- additive float masks ----------------------------------------------------------------------------------------


def test_finfo_min_additive_mask_folds_to_causal():
    def attention(q, k, v):  # HF's eager/sdpa float mask: torch.where(visible, 0, finfo.min)
        mask = torch.where(window_mask(S), torch.zeros(()), MIN)[None, None]
        return SDPA(q, k, v, attn_mask=mask)

    context, got, want = _detect(attention, *_qkv())
    match = _one_match(context)
    assert match.mask == MaskSpec.causal() and match.shardable and match.node.kwargs["is_causal"] is True
    torch.testing.assert_close(got, want)


def test_float_mask_with_a_value_between_zero_and_half_finfo_min_is_a_bias():
    def attention(q, k, v):
        mask = torch.where(window_mask(S), torch.zeros(()), MIN)
        mask[5, 2] = -1000.0
        return SDPA(q, k, v, attn_mask=mask)

    context, _, _ = _detect(attention, *_qkv())
    assert _one_match(context).refusal.code == "attention.mask_bias"


def test_runtime_additive_mask_is_refused_with_its_code():
    def attention(q, k, v, mask):
        return torch.softmax(q @ k.transpose(-2, -1) * 0.5 + mask, dim=-1) @ v

    mask = torch.where(window_mask(S), 0.0, MIN)
    context, got, want = _detect(attention, *_qkv(), mask)
    assert _one_match(context).refusal.code == "attention.mask_runtime"
    assert _codes(context) == ["attention.mask_runtime"]
    torch.testing.assert_close(got, want)


# -- manual attention (HF eager) ---------------------------------------------------------------------------------


def eager_attention(q, k, v, mask, scaling=D ** -0.5):
    """HF's eager_attention_forward (without repeat_kv): fp32 softmax, cast back, inactive dropout."""
    attn_weights = torch.matmul(q, k.transpose(2, 3)) * scaling
    attn_weights = attn_weights + mask[:, :, :, : k.shape[-2]]
    attn_weights = F.softmax(attn_weights, dim=-1, dtype=torch.float32).to(q.dtype)
    attn_weights = F.dropout(attn_weights, p=0.0, training=False)
    return torch.matmul(attn_weights, v)


@pytest.mark.parametrize("visible, expected", [
    (lambda: window_mask(S), MaskSpec.causal()),
    (lambda: window_mask(3), MaskSpec.causal() & SlidingWindow(2)),
], ids=["causal", "window"])
def test_hf_eager_pattern_becomes_sdpa(visible, expected):
    def attention(q, k, v):
        mask = torch.where(visible(), torch.zeros(()), MIN)[None, None]
        return eager_attention(q, k, v, mask)

    context, got, want = _detect(attention, *_qkv())
    match = _one_match(context)
    assert match.mask == expected and match.source == "manual" and match.refusal is None
    assert match.node.target is SDPA and match.scale == D ** -0.5
    torch.testing.assert_close(got, want)


def test_hf_eager_pattern_in_bf16_matches_up_to_bf16_rounding():
    # eager rounds the scores to bf16 before its fp32 softmax; SDPA keeps them in fp32: not bitwise
    def attention(q, k, v):
        mask = torch.where(window_mask(S), torch.zeros((), dtype=torch.bfloat16),
                           torch.finfo(torch.bfloat16).min)[None, None]
        return eager_attention(q, k, v, mask)

    context, got, want = _detect(attention, *(t.to(torch.bfloat16) for t in _qkv()))
    assert _one_match(context).mask == MaskSpec.causal() and got.dtype == torch.bfloat16
    torch.testing.assert_close(got, want, atol=2e-2, rtol=2e-2)


def test_masked_fill_with_finfo_min_and_a_band():
    def attention(q, k, v):  # MPT-style: masked_fill with finfo.min, softmax of the upcast scores
        att = (q @ k.transpose(-2, -1)) * 0.3
        att = att.masked_fill(~band_mask(1, 2), MIN)
        return F.softmax(att.float(), dim=-1).to(v.dtype) @ v

    context, got, want = _detect(attention, *_qkv())
    match = _one_match(context)
    assert match.mask == MaskSpec((SlidingWindow(1, 2),)) and match.node.target is SDPA
    torch.testing.assert_close(got, want)


# -- soft-capping ------------------------------------------------------------------------------------------------


def softcapped(q, k, v, cap=5.0):
    """Gemma-2's eager attention: soft-capped scaled scores, then the mask."""
    attn_weights = torch.matmul(q, k.transpose(2, 3)) * 0.5
    attn_weights = attn_weights / cap
    attn_weights = torch.tanh(attn_weights)
    attn_weights = attn_weights * cap
    attn_weights = attn_weights + torch.where(window_mask(S), torch.zeros(()), MIN)
    attn_weights = F.softmax(attn_weights, dim=-1, dtype=torch.float32).to(q.dtype)
    return torch.matmul(attn_weights, v)


def test_soft_cap_is_recorded_and_the_manual_attention_left_as_written():
    context, got, want = _detect(softcapped, *_qkv())
    match = _one_match(context)
    assert match.mask == MaskSpec.causal() & SoftCap(5.0)
    # no SDPA can drop the cap: the graph keeps the manual ops (exact if the shard pass refuses), the match
    # (on `probs @ v`) carries the SoftCap for the ring op, which replaces the whole attention
    assert match.refusal is None and match.shardable
    assert match.node.target is torch.matmul and context.report.rewrites == []
    from burstc.passes.detect_attention import manual_interior

    interior = manual_interior(match)
    assert interior and any(n.target is torch.tanh for n in interior)
    assert match.query not in interior and match.node not in interior
    torch.testing.assert_close(got, want)


def test_scale_after_the_cap_is_not_a_soft_cap():
    def attention(q, k, v):
        s = torch.tanh((q @ k.transpose(-2, -1)) / 5.0) * 5.0 * 0.5  # 2.5 * tanh(s / 5): not a soft-cap
        return F.softmax(s, dim=-1) @ v

    context, got, want = _detect(attention, *_qkv())
    assert context.facts.attention == {} and context.report.rewrites == []
    torch.testing.assert_close(got, want)


# -- ALiBi -------------------------------------------------------------------------------------------------------

SLOPES = (0.5, 0.125)


def alibi_bias(per_row_constant=False):
    i, j = _positions()
    distance = (j if per_row_constant else j - i).float()        # BLOOM adds slope * j: j - i plus a row constant
    bias = torch.tensor(SLOPES)[:, None, None] * distance
    return (bias + torch.where(window_mask(S), 0.0, MIN))[None]


@pytest.mark.parametrize("per_row_constant", [False, True], ids=["j_minus_i", "bloom_j"])
def test_alibi_bias_in_manual_attention(per_row_constant):
    def attention(q, k, v):
        return eager_attention(q, k, v, alibi_bias(per_row_constant))

    context, got, want = _detect(attention, *_qkv())
    match = _one_match(context)
    assert match.mask.terms == (Causal(),) and match.refusal is None and match.node.target is SDPA
    assert match.mask.term(Alibi).slopes == pytest.approx(SLOPES)
    torch.testing.assert_close(got, want)


@pytest.mark.parametrize("fill", [MIN, float("-inf")], ids=["finfo_min", "neg_inf"])
def test_alibi_and_a_mask_added_one_after_the_other(fill):
    """``(scores + alibi) + mask``, two additive terms (found by the fuzzer: no attention was detected, so the
    graph ran replicated): one additive mask, their sum, classified as causal with ALiBi."""
    def attention(q, k, v):
        i, j = _positions()
        scores = (q @ k.transpose(-2, -1)) * 0.5
        scores = scores + (torch.tensor(SLOPES)[:, None, None] * (j - i).float())[None]
        scores = scores + torch.zeros(S, S).masked_fill(~window_mask(S), fill)
        return F.softmax(scores, dim=-1) @ v

    context, got, want = _detect(attention, *_qkv())
    match = _one_match(context)
    assert match.refusal is None and match.node.target is SDPA and match.mask.terms == (Causal(),)
    assert match.mask.term(Alibi).slopes == pytest.approx(SLOPES)
    torch.testing.assert_close(got, want)


@pytest.mark.parametrize("style", ["additive", "bias_then_masked_fill"])
def test_alibi_added_after_a_soft_cap_is_refused(style):
    """c * tanh(s / c) + b is not ALiBi-then-cap (MaskSpec's order: c * tanh((s + b) / c)); found by the fuzzer
    once MPT's (scores + bias).masked_fill(...) was read: refused, never the other composition."""
    def attention(q, k, v):
        scores = torch.tanh((q @ k.transpose(-2, -1)) * 0.5 / 5.0) * 5.0
        if style == "additive":
            scores = scores + alibi_bias()
        else:
            scores = (scores + alibi_bias()[..., :, :].clamp(min=-1e3)).masked_fill(~window_mask(S), MIN)
        return F.softmax(scores, dim=-1, dtype=torch.float32) @ v

    context, got, want = _detect(attention, *_qkv())
    match = _one_match(context)
    assert match.refusal is not None and match.refusal.code == "attention.mask_bias", match
    assert "after a soft-cap" in match.refusal.reason
    torch.testing.assert_close(got, want)


def test_alibi_bias_given_to_sdpa_is_kept_on_the_node():
    def attention(q, k, v):
        return SDPA(q, k, v, attn_mask=alibi_bias())

    context, got, want = _detect(attention, *_qkv())
    match = _one_match(context)
    assert match.mask.term(Alibi).slopes == pytest.approx(SLOPES) and match.mask.term(Causal) == Causal()
    assert match.node.kwargs.get("attn_mask") is not None or len(match.node.args) > 3
    torch.testing.assert_close(got, want)


def test_scores_scaled_after_the_bias_are_left_alone():
    def attention(q, k, v):  # the bias is scaled with the scores: SDPA would add it unscaled
        return torch.softmax((q @ k.transpose(-2, -1) + alibi_bias()) * 0.5, dim=-1) @ v

    context, got, want = _detect(attention, *_qkv())
    assert context.facts.attention == {} and context.report.rewrites == []
    torch.testing.assert_close(got, want)


def test_bias_not_linear_in_distance_is_refused():
    def attention(q, k, v):
        i, j = _positions()
        bias = -0.1 * ((j - i).float() ** 2) + torch.where(window_mask(S), 0.0, MIN)
        return eager_attention(q, k, v, bias[None, None])

    context, got, want = _detect(attention, *_qkv())
    assert _one_match(context).refusal.code == "attention.mask_bias"
    assert _codes(context) == ["attention.mask_bias"] and context.report.rewrites == []
    torch.testing.assert_close(got, want)


def counted_alibi_attention(q, k, v, attention_mask, stretch=False):
    """BLOOM's ALiBi under a padded batch: the bias counts each row's real tokens, ``slope_h * pos_b(j)`` with
    ``pos = (attention_mask.cumsum(-1) - 1) * attention_mask``; ``stretch`` scales it by the row's real length
    (a bias that moves with the padding by more than a per-row constant)."""
    i, j = _positions()
    pos = ((attention_mask.cumsum(-1) - 1) * attention_mask).float()
    if stretch:
        pos = pos * attention_mask.sum(-1, keepdim=True) / S
    bias = torch.tensor(SLOPES)[None, :, None, None] * pos[:, None, None, :]
    visible = (j <= i) & attention_mask.bool()[:, None, None, :]
    return eager_attention(q, k, v, bias + torch.where(visible, 0.0, MIN))


@pytest.mark.parametrize("stretch", [False, True], ids=["counted", "stretched"])
def test_alibi_counting_real_tokens_is_exact_for_contiguous_padding(stretch):
    """Left or right padding shifts each row's counted ALiBi by a constant per query row (the softmax ignores
    it): one ALiBi and key padding, flagged exact only for contiguous padding (a hole is not; the backend checks
    each call).  A bias that moves by more than a constant on contiguous padding is refused."""
    attention_mask = torch.ones(B, S, dtype=torch.int64)
    attention_mask[:, :3] = 0
    context, got, want = _detect(functools.partial(counted_alibi_attention, stretch=stretch), *_qkv(), attention_mask)
    match = _one_match(context)
    torch.testing.assert_close(got, want)
    if stretch:
        assert match.refusal is not None and match.refusal.code == "attention.mask_runtime", match
        return
    assert match.refusal is None, match.refusal
    assert match.mask.term(KeyPadding).contiguous and match.mask.term(Causal) == Causal()
    assert match.mask.term(Alibi).slopes == pytest.approx(SLOPES)
    assert match.hidden_rows == "uniform"  # the pads' rows (all keys padding) average every key, as eager


def test_sdpa_float_key_padding_mask_has_no_hidden_row_mode():
    """SDPA given a finfo.min key-padding mask (Falcon's ALiBi path): a query row whose every key is padding is
    absorbed by the fill, and SDPA's kernels differ on its gradient (CPU's is S times the softmax's), so no ring
    mode mirrors it: calls with such rows run the unsharded graph (hidden_rows None), never "uniform"."""
    def attention(q, k, v, attention_mask):
        i, j = _positions()
        visible = (j <= i) & attention_mask.bool()[:, None, None, :]
        return SDPA(q, k, v, attn_mask=torch.where(visible, 0.0, MIN))

    attention_mask = torch.ones(B, S, dtype=torch.int64)
    attention_mask[:, :3] = 0
    context, got, want = _detect(attention, *_qkv(), attention_mask)
    match = _one_match(context)
    torch.testing.assert_close(got, want)
    assert match.refusal is None and match.mask.term(KeyPadding) is not None, match
    assert match.float_fill and match.hidden_rows is None


# -- HF models (graph-level: one match per layer) ----------------------------------------------------------------


def _hf(config_name, impl, **overrides):
    pytest.importorskip("transformers")
    from burstc.testing.zoo import hf_arch_variant

    return hf_arch_variant(config_name, impl, **overrides)


@pytest.mark.parametrize("config_name, impl, overrides, expected", [
    ("LlamaConfig", "eager", {}, MaskSpec.causal()),
    ("MistralConfig", "sdpa", {"sliding_window": 8}, MaskSpec.causal() & SlidingWindow(7)),
    ("MistralConfig", "eager", {"sliding_window": 8}, MaskSpec.causal() & SlidingWindow(7)),
    ("Qwen2Config", "sdpa", {"sliding_window": 8, "use_sliding_window": True, "max_window_layers": 0},
     MaskSpec.causal() & SlidingWindow(7)),
    ("Gemma2Config", "eager", {}, MaskSpec.causal() & SoftCap(50.0)),
], ids=["llama_eager", "mistral_sdpa", "mistral_eager", "qwen2_sdpa", "gemma2_eager"])
def test_hf_models_yield_one_match_per_layer(config_name, impl, overrides, expected):
    from burstc.testing.zoo import hf_arch_inputs

    model = _hf(config_name, impl, **overrides)
    context, got, want = _detect(lambda ids: model(input_ids=ids, use_cache=False).logits, hf_arch_inputs())
    matches = list(context.facts.attention.values())
    assert len(matches) == model.config.num_hidden_layers
    assert all(m.mask == expected for m in matches), [str(m.mask) for m in matches]
    if expected.term(SoftCap):  # left as written, replaced whole by the ring op when sharded
        assert all(m.refusal is None and m.shardable and m.node.target is torch.matmul for m in matches)
    else:
        assert all(m.refusal is None and m.shardable == expected.ring_supported for m in matches)
        assert all(m.node.target is SDPA and m.kv_heads == 2 and m.heads_q == 4 for m in matches)
    torch.testing.assert_close(got, want)


@pytest.mark.parametrize("impl", ["sdpa", "eager"])
def test_hf_falcon_alibi_is_detected_per_layer(impl):
    from burstc.testing.zoo import hf_arch_inputs

    model = _hf("FalconConfig", impl, alibi=True, new_decoder_architecture=False, num_kv_heads=4)
    context, got, want = _detect(lambda ids: model(input_ids=ids, use_cache=False).logits, hf_arch_inputs())
    matches = list(context.facts.attention.values())
    assert len(matches) == model.config.num_hidden_layers
    # Falcon's slopes 2^-2, 2^-4, ... with the 1/sqrt(head_dim) it applies to the biased scores folded in
    slopes = [2.0 ** (-2 * (h + 1)) * 8 ** -0.5 for h in range(4)]
    for m in matches:
        assert m.mask.terms == (Causal(),) and m.refusal is None and m.node.target is SDPA
        assert m.mask.term(Alibi).slopes == pytest.approx(slopes, rel=1e-5)
    torch.testing.assert_close(got, want)


@pytest.mark.parametrize("row_chunk", [2, 1024])
@pytest.mark.parametrize("seq", [2, 5, 9])
def test_every_static_band_is_classified_with_its_exact_visibility(seq, row_chunk, monkeypatch):
    """Every causal / window / band of every width up to the whole sequence (the widths next to S - 1
    included, where a window stops hiding anything) comes back as a spec with exactly that visibility, also when
    the visibility is read a few rows at a time (``ROW_CHUNK``: long masks are); a mask that is none of them, or
    that differs from one in a single entry of a later chunk, is not."""
    from burstc.passes import mask_classification
    from burstc.passes.mask_classification import spec_of_visibility

    monkeypatch.setattr(mask_classification, "ROW_CHUNK", row_chunk)
    pos = torch.arange(seq)
    if seq > 2:
        nearly = MaskSpec.causal().visible(pos, pos).clone()
        nearly[seq - 1, 1] = False  # a hole in the last row: not causal, not a window
        assert spec_of_visibility(nearly) is None
        strict = pos[:, None] > pos[None, :]
        strict[0, 0] = True  # the first row sees itself, every later row only the keys before it
        assert spec_of_visibility(strict) is None
    widths = [None, *range(seq)]
    for causal in (False, True):
        for left in widths:
            for right in [None] if causal else widths:
                terms = ([Causal()] if causal else []) + (
                    [SlidingWindow(left, right)] if left is not None or right is not None else [])
                visible = MaskSpec(tuple(terms)).visible(pos, pos)
                found = spec_of_visibility(visible)
                assert found is not None, (seq, terms)
                assert torch.equal(found.visible(pos, pos), visible), (seq, terms, found)


def test_manual_attention_divided_by_sqrt_d_keeps_its_scale():
    """``scores / sqrt(d)`` (GPT-2, nanoGPT's manual path) is the scale 1 / sqrt(d), not sqrt(d)."""
    def attention(q, k, v):
        scores = (q @ k.transpose(-2, -1)) / (D ** 0.5)
        return torch.softmax(scores.masked_fill(~window_mask(S), float("-inf")), dim=-1) @ v

    context, got, want = _detect(attention, *_qkv())
    match = _one_match(context)
    assert match.refusal is None and match.mask == MaskSpec.causal()
    assert match.scale == pytest.approx(D ** -0.5)
    torch.testing.assert_close(got, want)


@pytest.mark.parametrize("style", ["additive", "softcap", "sdpa", "bf16_qkv", "sdpa_bool_mask"])
def test_attention_under_autocast_runs_on_the_inputs_autocast_casts(style):
    """HF's eager attention under ``torch.autocast``: q and k fp32 (RoPE's products), v bf16 (a projection),
    both matmuls in bf16, the fp32 mask promoting the scores (found by the fuzzer: not detected, so 18 of 20 such
    cases ran replicated).  The attention computes on q, k, v cast to bf16 as autocast casts them: canonicalized
    to SDPA (with the mask cast too), or, soft-capped, left as written on the cast inputs; SDPA under autocast
    gets its inputs cast in the graph too; q, k, v already bf16 (Cohere-2 casts RoPE's result back) meet only the
    fp32 mask, cast for SDPA.  The graph's result is eager's."""
    def attention(q, k, v):
        mask = torch.zeros(S, S).masked_fill(~window_mask(4), MIN)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            v = v.to(torch.bfloat16)  # as a bf16 projection leaves it
            if style == "bf16_qkv":
                q, k = q.to(torch.bfloat16), k.to(torch.bfloat16)
            if style == "sdpa":
                return SDPA(q, k, v, attn_mask=mask)
            if style == "sdpa_bool_mask":  # q, k, v cast; the bool mask stays bool (not a 0/1 bias)
                return SDPA(q, k, v, attn_mask=window_mask(4))
            scores = (q @ k.transpose(-2, -1)) * 0.5
            if style == "softcap":
                scores = torch.tanh(scores / 5.0) * 5.0
            probs = F.softmax(scores + mask, dim=-1, dtype=torch.float32).to(q.dtype)
            return probs @ v

    context, got, want = _detect(attention, *_qkv())
    match = _one_match(context)
    assert match.refusal is None and match.mask.terms == (Causal(), SlidingWindow(3))
    from burstc.passes.graph_utils import val

    assert [val(t).dtype for t in (match.query, match.key, match.value)] == [torch.bfloat16] * 3
    # the report's cast_to: q, k, v cast for autocast's matmuls (bf16 already: only the mask was cast)
    assert match.cast_to == (None if style == "bf16_qkv" else torch.bfloat16)
    assert all(n.target == "to" for n in (match.query, match.key)) and got.dtype == want.dtype == torch.bfloat16
    if match.node.target is SDPA and style != "sdpa":  # the fp32 mask went in cast to bf16, a bool one as it was
        expected = torch.bool if style == "sdpa_bool_mask" else torch.bfloat16
        assert val(match.node.kwargs["attn_mask"]).dtype == expected
    assert (match.node.target is SDPA) == (style != "softcap")
    if style == "softcap":  # as written: its scores matmul reads the cast q (the ring op replaces it all)
        assert any(u.target in (torch.matmul, operator.matmul) for u in match.query.users)
        torch.testing.assert_close(got, want, atol=0, rtol=0)
    else:  # SDPA's kernel keeps the probabilities in fp32 where eager rounds them to bf16: bf16 ulps apart
        from burstc.testing.oracle import tolerance

        tol = tolerance(torch.bfloat16, "attention_out")
        error = (got.float() - want.float()).abs().max()
        assert error <= tol.atol + tol.rtol * want.float().abs().max(), error
