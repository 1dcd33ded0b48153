"""The cost model (:mod:`burstc.cost_model`): its overlap arithmetic by hand, and the ring it picks."""
from __future__ import annotations

import pytest
import torch

from burstc.attention_ir import MaskSpec, SlidingWindow
from burstc.cost_model import Machine, choose_ring, machine_from_options, predicted_ring_cost

SHAPE = (1, 4, 4, 16, torch.float32)  # B, Hq, Hkv, D, dtype


def _machine(flops, intra, inter):
    return Machine(attention_flops=flops, bandwidth=(("intra", intra), ("inter", inter)))


@pytest.mark.parametrize("intra,inter", [(1e6, 1e5), (1e5, 1e6), (1e7, 1e7), (1e12, 1e12)])
def test_full_attention_on_2x2_by_hand(intra, inter):
    """Full mask, contiguous layout, 2 x 2: every step attends one whole shard pair (compute c) and every
    transfer is one shard's K, V (bytes b).  Flat: rank 0 sends to ranks 1 (intra), 2, 3 (inter), one per
    step.  Double: outer step 0 runs its two inner steps (one intra transfer) while lane 1 crosses."""
    seq_len, local = 64, 16
    B, Hq, Hkv, D, dtype = SHAPE
    flops = 1e9
    c = 4 * D * B * Hq * local * local / flops
    b = 2 * B * Hkv * local * D * 4
    machine = _machine(flops, intra, inter)
    t_intra, t_inter = b / intra, b / inter
    flat = predicted_ring_cost("flat", "contiguous", MaskSpec.full(), seq_len, 2, 2, *SHAPE, "kv_ring", machine)
    double = predicted_ring_cost("double", "contiguous", MaskSpec.full(), seq_len, 2, 2, *SHAPE, "kv_ring", machine)
    # the slowest rank: rank 1 sends to 2 (inter), 3 (inter), 0 (intra) in that order; the sum is the same
    assert flat.forward == pytest.approx(max(c, t_intra) + 2 * max(c, t_inter) + c)
    assert double.forward == pytest.approx(max(max(c, t_intra) + c, t_inter) + max(c, t_intra) + c)
    assert flat.compute == double.compute == pytest.approx(c * 4 * (1 + 10 / 4))


def test_unlimited_links_cost_only_compute():
    machine = _machine(1e9, 1e18, 1e18)
    for ring in ("flat", "double"):
        cost = predicted_ring_cost(ring, "zigzag", MaskSpec.causal(), 256, 2, 2, *SHAPE, "burst", machine)
        assert cost.total == pytest.approx(cost.compute, rel=1e-6)


@pytest.mark.parametrize("mask", [MaskSpec.causal(), MaskSpec.causal() & SlidingWindow(20), MaskSpec.full()])
@pytest.mark.parametrize("mesh", [(2, 2), (2, 4), (4, 2)])
def test_choice_is_the_faster_ring_and_slow_inter_links_favour_the_double_ring(mask, mesh):
    args = ("zigzag", mask, 1024, *mesh, *SHAPE)
    for machine in (_machine(1e9, 1e8, 1e6), _machine(1e9, 1e6, 1e8), _machine(1e12, 1e9, 1e9)):
        best, costs = choose_ring(*args, lambda ring: "burst", machine)
        fastest = min(c.total for c in costs.values())
        assert costs[best].total <= fastest * 1.01  # within the near-tie margin of the fastest
        earlier = ("double", "ulysses", "flat")[:("double", "ulysses", "flat").index(best)]
        assert all(costs[ring].total > fastest * 1.01 for ring in earlier)  # ties go to fewer inter-node bytes
    best, costs = choose_ring(*args, lambda ring: "burst", _machine(1e12, 1e9, 1e6))
    if mask != MaskSpec.causal() & SlidingWindow(20):  # a short window moves a halo only, between neighbours
        # both two-level plans cross nodes once per block; the flat ring G times
        assert best != "flat" and costs["double"].total < costs["flat"].total
        assert costs["ulysses"].total < costs["flat"].total


def test_hybrid_costs_its_all_to_alls_and_a_ring_over_the_nodes():
    """Full mask, 2 x 2, contiguous, unlimited inter links: the hybrid's time is its compute plus the
    all-to-alls at the intra-node rate: q, k, v, out and the LSE, half of each leaves the rank."""
    seq_len, local, flops, intra = 64, 16, 1e9, 1e6
    B, Hq, Hkv, D, dtype = SHAPE
    machine = _machine(flops, intra, 1e18)
    cost = predicted_ring_cost("ulysses", "contiguous", MaskSpec.full(), seq_len, 2, 2, *SHAPE, "kv_ring", machine)
    element = 4
    forward_a2a = local // 2 * B * (Hq * D * element * 2 + Hkv * D * element * 2 + Hq * 4)
    compute_forward = 4 * D * B * (Hq // 2) * (2 * local) ** 2 * 2 / flops  # 2 node pairs of 2 shards each
    assert cost.forward == pytest.approx(compute_forward + forward_a2a / intra)


def test_machine_options_override_the_defaults():
    machine = machine_from_options("cuda", {"inter": 25e9}, None)
    assert dict(machine.bandwidth) == {"intra": 450e9, "inter": 25e9} and machine.attention_flops == 400e12
    assert machine_from_options("cpu", None, 1e10).attention_flops == 1e10
