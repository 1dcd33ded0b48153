"""The communication planner: plan choice, byte formulas, and formulas == bytes actually sent."""
from __future__ import annotations

import pytest
import sympy
import torch

from burstc import layout as layouts
from burstc import planner
from burstc.attention_ir import MaskSpec
from burstc.planner import plan_attention


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.float16])
def test_burst_for_mha_kv_ring_for_gqa(dtype):
    assert plan_attention(1, 4096, 4, 32, 32, 128, dtype).plan == "burst"
    assert plan_attention(1, 4096, 4, 32, 16, 128, dtype).plan == "kv_ring"  # Hq = 2 Hkv
    assert plan_attention(1, 4096, 4, 32, 8, 128, dtype).plan == "kv_ring"   # Hq = 4 Hkv
    assert plan_attention(1, 4096, 4, 32, 1, 128, dtype).plan == "kv_ring"   # MQA


@pytest.mark.parametrize("dtype,expected", [(torch.bfloat16, 1032 / 1536), (torch.float32, 1544 / 2048)])
def test_mha_burst_over_kv_ring_ratio_at_head_dim_128(dtype, expected):
    plan = plan_attention(2, 32768, 8, 40, 40, 128, dtype)
    assert plan.plan == "burst" and plan.alternative == "kv_ring"
    ratio = plan.predicted_bytes["backward"] / plan.alternative_bytes["backward"]
    assert ratio == pytest.approx(expected, rel=1e-12) and ratio <= 0.76
    assert plan.backward_ratio == pytest.approx(ratio, rel=1e-12)


def test_formulas_by_hand():
    batch, seq_len, world, heads_q, heads_kv, head_dim, a = 2, 96, 3, 6, 2, 16, 2
    s = seq_len // world
    plan = plan_attention(batch, seq_len, world, heads_q, heads_kv, head_dim, torch.bfloat16)
    kv_ring = 2 * batch * s * heads_kv * head_dim * a + 2 * batch * s * heads_kv * head_dim * 4
    burst = 2 * batch * s * heads_q * head_dim * a + batch * s * heads_q * head_dim * 4 + 2 * batch * s * heads_q * 4
    assert plan.predicted_bytes == {"forward": 2 * batch * s * heads_kv * head_dim * a, "backward": kv_ring}
    assert plan.alternative_bytes["backward"] == burst
    assert plan.total_bytes == {"forward": (world - 1) * 2 * batch * s * heads_kv * head_dim * a,
                                "backward": (world - 1) * kv_ring}
    assert plan.alternative_total_bytes["backward"] == (world - 1) * burst


def test_symbolic_expressions():
    P = planner.P
    for per_step, per_call in [(planner.FORWARD_BYTES_PER_STEP, planner.FORWARD_BYTES_PER_CALL),
                               (planner.KV_RING_BACKWARD_BYTES_PER_STEP, planner.KV_RING_BACKWARD_BYTES_PER_CALL),
                               (planner.BURST_BACKWARD_BYTES_PER_STEP, planner.BURST_BACKWARD_BYTES_PER_CALL)]:
        assert sympy.simplify(per_call - (P - 1) * per_step) == 0
    mha_ratio = (planner.BURST_BACKWARD_BYTES_PER_STEP / planner.KV_RING_BACKWARD_BYTES_PER_STEP).subs(planner.Hkv, planner.Hq)
    D, a = planner.D, planner.a
    assert sympy.simplify(mha_ratio - (2 * D * a + 4 * D + 8) / (2 * D * (a + 4))) == 0
    expressions = plan_attention(1, 64, 4, 4, 4, 8, torch.float32).expressions
    assert set(expressions) == {"forward", "kv_ring", "burst"}
    assert expressions["burst"] is planner.BURST_BACKWARD_BYTES_PER_STEP


def test_single_rank_sends_nothing():
    plan = plan_attention(1, 64, 1, 4, 4, 8, torch.float32)
    assert plan.predicted_bytes == plan.total_bytes == {"forward": 0, "backward": 0}


def test_bad_arguments():
    with pytest.raises(ValueError, match="multiple of heads_kv"):
        plan_attention(1, 64, 2, 4, 3, 8, torch.float32)
    with pytest.raises(ValueError, match="multiple of world_size"):
        plan_attention(1, 65, 2, 4, 4, 8, torch.float32)


# ---------------------------------------------------------------------------------------------
# The prediction is exactly what the op sends


def _measure_bytes(rank, world_size, shape, dtype, layout, causal, plan):
    from burstc.ops import ring_attention as ra

    batch, heads_q, heads_kv, local_len, head_dim = shape
    generator = torch.Generator().manual_seed(0)
    seq_len = local_len * world_size
    q = torch.randn(batch, heads_q, seq_len, head_dim, generator=generator).to(dtype)
    k, v = (torch.randn(batch, heads_kv, seq_len, head_dim, generator=generator).to(dtype) for _ in range(2))
    q_l, k_l, v_l = (layouts.shard(t, 2, world_size, rank, layout).requires_grad_() for t in (q, k, v))
    with ra.record_stats() as stats:
        out = ra.ring_attention(q_l, k_l, v_l, causal=causal, layout=layout, plan=plan)
        out.sum().backward()
    (forward,), (backward,) = stats.of("forward"), stats.of("backward")
    return {"forward_per_step": forward.bytes_sent_per_step, "forward_total": forward.total_bytes_sent,
            "backward_per_step": backward.bytes_sent_per_step, "backward_total": backward.total_bytes_sent,
            "backward_received": backward.bytes_received_per_step, "plan": backward.plan}


@pytest.mark.multirank
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("heads", [(4, 4), (4, 1), (6, 2)], ids=["mha", "mqa", "gqa"])
@pytest.mark.parametrize("world_size", [2, 3, 4])
def test_byte_counter_equals_prediction(workers, world_size, heads, dtype):
    """Full attention sends the dense formulas; causal sends only the rows each pair needs, exactly as
    :func:`planner.predicted_transfers` counts them, and the cheaper plan for ``"auto"`` under the mask."""
    heads_q, heads_kv = heads
    batch, local_len, head_dim = 2, 6, 8
    seq_len = local_len * world_size
    prediction = plan_attention(batch, seq_len, world_size, heads_q, heads_kv, head_dim, dtype)
    values = (batch, seq_len, world_size, heads_q, heads_kv, head_dim, torch.empty((), dtype=dtype).element_size())
    group = workers.get(world_size)
    for plan, layout, causal in [("kv_ring", "zigzag", True), ("burst", "striped", True),
                                 ("kv_ring", "contiguous", True), ("burst", "contiguous", False), ("auto", "zigzag", True),
                                 ("kv_ring", "zigzag", False)]:
        mask = MaskSpec.causal() if causal else MaskSpec.full()
        transfers = planner.predicted_transfers(layout, mask, seq_len, world_size, batch, heads_q, heads_kv, head_dim,
                                                dtype)
        resolved = planner.cheaper_backward(transfers) if plan == "auto" else plan
        results = group.run(_measure_bytes, (batch, heads_q, heads_kv, local_len, head_dim), dtype, layout, causal, plan)
        for rank, got in enumerate(results):
            context = (rank, plan, layout, causal)
            assert got["plan"] == resolved, context
            assert got["forward_per_step"] == list(transfers["forward"].sent_per_step[rank]), context
            assert got["backward_per_step"] == list(transfers[resolved].sent_per_step[rank]), context
            assert got["backward_received"] == list(transfers[resolved].received_per_step[rank]), context
            assert len(got["backward_per_step"]) == world_size + 1, context
            if not causal:  # every pair needs every row: the dense formulas
                assert got["forward_total"] == prediction.total_bytes["forward"], context
                assert got["forward_per_step"] == [prediction.predicted_bytes["forward"]] * (world_size - 1) + [0]
                assert got["backward_total"] == planner._bytes(planner.BACKWARD_BYTES_PER_CALL[resolved], values)
            else:  # skipping never sends more than the dense ring
                assert got["forward_total"] <= prediction.total_bytes["forward"], context


@pytest.mark.parametrize("layout", ["contiguous", "zigzag", "striped"])
@pytest.mark.parametrize("world_size", [1, 2, 3, 4])
@pytest.mark.parametrize("causal", [True, False])
def test_predicted_work_is_the_visible_area_of_each_ranks_queries(layout, world_size, causal):
    from burstc.attention_ir import MaskSpec
    from burstc.layout import local_positions, required_multiple
    from burstc.planner import predicted_work

    mask = MaskSpec.causal() if causal else MaskSpec.full()
    seq_len = 6 * required_multiple(world_size, layout)
    balance = predicted_work(layout, mask, seq_len, world_size)
    everything = torch.arange(seq_len)
    dense = [int(mask.visible(local_positions(seq_len, world_size, r, layout), everything).sum())
             for r in range(world_size)]
    assert list(balance.per_rank) == dense
    if layout == "zigzag" or not causal:
        assert balance.max_over_mean == 1.0
    elif layout == "contiguous" and world_size > 1:
        assert balance.max_over_mean > 1.4  # the last rank sees everything before it


# ---------------------------------------------------------------------------------------------
# Closed forms for full and causal masks (what makes S = 1M on 64 ranks take seconds)

@pytest.mark.parametrize("layout", ["contiguous", "zigzag", "striped"])
@pytest.mark.parametrize("world_size,local_len", [(1, 6), (2, 4), (3, 10), (5, 2), (8, 6)])
def test_causal_rows_seen_in_closed_form_equal_the_interval_search(layout, world_size, local_len):
    from burstc.attention_ir import Causal, SlidingWindow
    from burstc.block_geometry import _pair_rows_seen

    # a window wider than the sequence sees what causal sees, through the interval search
    wide = (Causal(), SlidingWindow(world_size * local_len, None))
    for q_owner in range(world_size):
        for kv_owner in range(world_size):
            closed = _pair_rows_seen(layout, (Causal(),), q_owner, kv_owner, local_len, world_size)
            searched = _pair_rows_seen(layout, wide, q_owner, kv_owner, local_len, world_size)
            assert closed == searched, (q_owner, kv_owner)


@pytest.mark.parametrize("layout", ["contiguous", "zigzag", "striped"])
@pytest.mark.parametrize("world_size,local_len", [(1, 6), (2, 4), (3, 10), (4, 2), (7, 6)])
@pytest.mark.parametrize("causal", [True, False])
def test_bound_without_window_equals_the_interval_count(layout, world_size, local_len, causal):
    from burstc.attention_ir import Causal

    seq_len = world_size * local_len
    positions_PS = torch.stack([layouts.local_positions(seq_len, world_size, r, layout) for r in range(world_size)])
    closed = planner._seen_without_window(positions_PS, causal)
    counted = planner._seen_by_intervals(positions_PS, MaskSpec((Causal(),) if causal else ()))
    assert all(torch.equal(a, b) for a, b in zip(closed, counted))


def test_planner_at_1m_tokens_on_64_ranks_in_seconds():
    import time

    from burstc.attention_ir import Causal

    started = time.perf_counter()
    plan = planner.masked_plan("zigzag", MaskSpec((Causal(),)), 2**20, 64, 1, 32, 32, 128, torch.bfloat16)
    assert time.perf_counter() - started < 30  # minutes before the closed forms (a loaded 2-core box: ~2 s)
    assert plan.plan == "burst" and plan.over_bound["forward"] == pytest.approx(1.0)
