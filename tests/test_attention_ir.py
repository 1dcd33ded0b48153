"""MaskSpec: construction, canonical form, encoding for custom ops, and the dense visibility reference."""
from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from burstc.attention_ir import (Alibi, Causal, Documents, FlexMask, FlexScore, KeyPadding, MaskSpec, SlidingWindow,
                                 SoftCap)


def test_full_and_causal():
    assert MaskSpec.full().is_full and MaskSpec.full().encode() == "full" and MaskSpec.full().ring_supported
    causal = MaskSpec.causal()
    assert causal.is_causal and not causal.is_full and causal.kind == "causal" and causal.ring_supported
    windowed = causal & SlidingWindow(3)
    assert not windowed.is_causal and windowed.ring_supported  # static: the ring executes it
    assert (causal & Documents("doc_ids")).ring_supported  # runtime data: the op takes it as tensors
    assert not (causal & FlexMask("mask_0")).ring_supported


def test_terms_are_canonically_ordered_and_unique():
    a = MaskSpec((SlidingWindow(4, None), Causal()))
    b = MaskSpec.causal() & SlidingWindow(4)
    assert a == b and a.encode() == "causal&window(4,-)"
    with pytest.raises(ValueError, match="at most one term of each kind"):
        MaskSpec((Causal(), Causal()))
    with pytest.raises(ValueError):
        SlidingWindow(-1)
    with pytest.raises(ValueError):
        SoftCap(0.0)


_specs = st.builds(
    lambda causal, window, docs, pad, flex, alibi, cap, score: MaskSpec(
        tuple(t for t in (Causal() if causal else None, window, docs, pad, flex) if t is not None),
        tuple(m for m in (alibi, cap, score) if m is not None)),
    st.booleans(),
    st.none() | st.builds(SlidingWindow, st.none() | st.integers(0, 5000), st.none() | st.integers(0, 5000)),
    st.none() | st.sampled_from([Documents("position_ids"), Documents("doc_ids")]),
    st.none() | st.sampled_from([KeyPadding("attention_mask"), KeyPadding("attention_mask", contiguous=True)]),
    st.none() | st.just(FlexMask("mask_graph_0")),
    st.none() | st.builds(lambda xs: Alibi(tuple(xs)), st.lists(st.floats(0.001, 1.0), min_size=1, max_size=4)),
    st.none() | st.builds(SoftCap, st.floats(0.5, 100.0)),
    st.none() | st.just(FlexScore("score_graph_0")),
)


@given(_specs)
@settings(max_examples=200, deadline=None)
def test_encode_decode_round_trip(spec):
    assert MaskSpec.decode(spec.encode()) == spec
    assert (spec & MaskSpec.full()) == spec


def test_padding_is_contiguous():
    from burstc.attention_ir import padding_is_contiguous

    rows = {"right": [1, 1, 1, 0, 0], "left": [0, 0, 1, 1, 1], "both": [0, 1, 1, 0, 0], "none": [1] * 5,
            "all_pads": [0] * 5, "hole": [1, 1, 0, 1, 0], "left_hole": [0, 1, 0, 1, 1]}
    for name, row in rows.items():
        with_ones = torch.tensor([row, [1] * 5])
        assert padding_is_contiguous(with_ones) == ("hole" not in name), name
    assert KeyPadding("m", contiguous=True).encode() == "key_padding(m,contiguous)"
    with pytest.raises(ValueError):
        MaskSpec.decode("key_padding(m,holes)")


def test_runtime_sources():
    spec = MaskSpec.causal() & Documents("position_ids") & KeyPadding("attention_mask")
    assert spec.runtime_sources == ("position_ids", "attention_mask")
    assert spec.term(Documents) == Documents("position_ids") and spec.term(SoftCap) is None


def _brute_visible(spec, s_q, s_kv, docs=None, valid=None):
    out = torch.zeros(s_q, s_kv, dtype=torch.bool)
    for i in range(s_q):
        for j in range(s_kv):
            ok = True
            for t in spec.terms:
                if isinstance(t, Causal):
                    ok &= j <= i
                elif isinstance(t, SlidingWindow):
                    ok &= (t.left is None or j >= i - t.left) and (t.right is None or j <= i + t.right)
                elif isinstance(t, Documents):
                    ok &= bool(docs[i] == docs[j])
                elif isinstance(t, KeyPadding):
                    ok &= bool(valid[j])
            out[i, j] = ok
    return out


@given(st.integers(1, 12), st.booleans(), st.none() | st.integers(0, 6), st.none() | st.integers(0, 6),
       st.booleans(), st.booleans(), st.integers(0, 2**31 - 1))
@settings(max_examples=150, deadline=None)
def test_visible_matches_a_brute_force_reference(seq, causal, left, right, documents, padding, seed):
    gen = torch.Generator().manual_seed(seed)
    terms = [Causal()] if causal else []
    if left is not None or right is not None:
        terms.append(SlidingWindow(left, right))
    docs = torch.cumsum(torch.rand(seq, generator=gen) < 0.3, 0)
    valid = torch.rand(seq, generator=gen) < 0.8
    if documents:
        terms.append(Documents("doc_ids"))
    if padding:
        terms.append(KeyPadding("attention_mask"))
    spec = MaskSpec(tuple(terms))
    positions = torch.arange(seq)
    got = spec.visible(positions, positions, q_docs=docs, kv_docs=docs, kv_valid=valid)
    assert torch.equal(got, _brute_visible(spec, seq, seq, docs, valid))


def test_visible_on_permuted_positions_is_the_permuted_dense_mask():
    spec = MaskSpec.causal() & SlidingWindow(2)
    perm = torch.tensor([0, 7, 1, 6, 2, 5, 3, 4])  # a zigzag-like order
    dense = spec.visible(torch.arange(8), torch.arange(8))
    assert torch.equal(spec.visible(perm, perm), dense[perm][:, perm])


def test_visible_needs_the_runtime_data_it_reads():
    with pytest.raises(ValueError, match="q_docs"):
        (MaskSpec.causal() & Documents("position_ids")).visible(torch.arange(4), torch.arange(4))
    with pytest.raises(NotImplementedError):
        MaskSpec((FlexMask("g"),)).visible(torch.arange(4), torch.arange(4))


def test_fully_hidden_rows_agree_with_dense_visibility():
    """has_fully_hidden_rows (O(B * S) ranges; unsorted document ids through the dense visibility) vs the dense
    visibility on random paddings, windows, bands and documents (sorted runs and unsorted ids)."""
    from burstc.attention_ir import Documents, KeyPadding, SlidingWindow, has_fully_hidden_rows

    specs = [MaskSpec.causal() & KeyPadding("m"), MaskSpec.full() & KeyPadding("m"),
             MaskSpec.causal() & SlidingWindow(3) & KeyPadding("m"), MaskSpec((SlidingWindow(2, 1), KeyPadding("m"))),
             MaskSpec.causal() & Documents("p", ids=True) & KeyPadding("m"),
             MaskSpec.full() & Documents("p", ids=True) & KeyPadding("m")]
    g = torch.Generator().manual_seed(0)
    seen = set()
    for trial in range(300):
        spec = specs[trial % len(specs)]
        seq = int(torch.randint(1, 20, (), generator=g))
        valid = torch.rand(2, seq, generator=g) < float(torch.rand((), generator=g))
        docs = (torch.cumsum((torch.rand(2, seq, generator=g) < 0.3).long(), -1) if trial % 3 == 0
                else torch.randint(0, 3, (2, seq), generator=g))
        i = torch.arange(seq)
        want = bool((~spec.visible(i, i, q_docs=docs, kv_docs=docs, kv_valid=valid).any(-1)).any())
        assert has_fully_hidden_rows(spec, doc_ids_BS=docs, key_valid_BS=valid) == want, (spec, valid, docs)
        seen.add(want)
    assert seen == {True, False}
    assert not has_fully_hidden_rows(MaskSpec.causal(), key_valid_BS=torch.zeros(1, 4, dtype=torch.bool))
