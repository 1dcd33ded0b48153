"""The mask-aware ring: only the rows a pair needs travel, counted bytes == predicted == the bound.

Single-process: :func:`travelling_rows` against dense visibility, every block inside the rows that
travel, the planner's predicted transfers against the independently counted zero-redundancy bound,
the per-row formulas against the dense ones, the sliding-window and causal savings, the simulator.
Multi-rank (gloo, P = 2 and 4): per mask kind (full, causal, windows shorter than a shard, of a shard
and spanning several shards, two-sided, documents, padding) x every layout x both backward plans, the
op's results against single-device SDPA and its byte counters (sent and received, per rank and step)
against :func:`burstc.planner.predicted_transfers`, its received bytes against the bound, and the
balance simulator's work and bytes against the same counters.
"""
from __future__ import annotations


import pytest
import sympy
import torch

from burstc import layout as layouts
from burstc import planner
from burstc.attention_ir import Documents, KeyPadding, MaskSpec, SlidingWindow
from burstc.block_geometry import CAUSAL, POSITIONS, blocks, pairs_hidden_by_data, runs_length, travelling_rows
from burstc.ops import ring_attention as ra
from burstc.testing import balance, tolerance
from burstc.testing.ring_cases import ring_attention_case, runtime_mask_data

CAUSAL_SPEC = MaskSpec.causal()
DOCS, PAD = Documents("doc_ids"), KeyPadding("attention_mask")
WORKER_RUN_TIMEOUT_S = 300


def static_masks(local_len: int) -> dict[str, MaskSpec]:
    """Static mask kinds on shards of ``local_len`` tokens."""
    return {
        "full": MaskSpec.full(),
        "causal": CAUSAL_SPEC,
        "window_lt_shard": CAUSAL_SPEC & SlidingWindow(max(0, local_len // 2 - 1)),
        "window_shard": CAUSAL_SPEC & SlidingWindow(local_len - 1),
        "window_multi_shard": CAUSAL_SPEC & SlidingWindow(2 * local_len + 1),
        "two_sided": MaskSpec((SlidingWindow(local_len // 2, 1),)),
    }


def _rows_of(flags: torch.Tensor) -> set[int]:
    return set(flags.nonzero().flatten().tolist())


def _rows_in(runs) -> set[int]:
    return {i for start, stop in runs for i in range(start, stop)}


@pytest.mark.parametrize("layout", layouts.LAYOUTS)
@pytest.mark.parametrize("world_size", [1, 2, 3, 4])
def test_travelling_rows_are_exactly_the_rows_the_pair_needs(layout, world_size):
    """K/V rows that travel = keys some query of the receiver sees; query rows = queries that see some key
    of the receiver; and every block of the pair reads only rows that travelled."""
    for local_len in ((2, 4, 6) if layout == "zigzag" else (1, 3, 5)):
        seq_len = local_len * world_size
        positions = [layouts.local_positions(seq_len, world_size, r, layout) for r in range(world_size)]
        for name, mask in static_masks(local_len).items():
            for q_owner in range(world_size):
                for kv_owner in range(world_size):
                    context = (layout, local_len, name, q_owner, kv_owner)
                    visible = mask.visible(positions[q_owner], positions[kv_owner])
                    kv_runs = travelling_rows(False, layout, mask, q_owner, kv_owner, local_len, world_size)
                    q_runs = travelling_rows(True, layout, mask, kv_owner, q_owner, local_len, world_size)
                    assert _rows_in(kv_runs) == _rows_of(visible.any(0)), context
                    assert _rows_in(q_runs) == _rows_of(visible.any(1)), context
                    assert runs_length(kv_runs) == len(_rows_in(kv_runs)), context  # disjoint
                    for block in blocks(layout, mask, q_owner, kv_owner, local_len, world_size):
                        shown = torch.zeros_like(visible)
                        shown[block.q_rows, block.kv_rows] = True
                        if block.mask == CAUSAL:
                            shown[block.q_rows, block.kv_rows] = torch.ones(
                                block.q_stop - block.q_start, block.kv_stop - block.kv_start, dtype=torch.bool).tril()
                        if block.mask == POSITIONS:
                            shown &= visible
                        assert _rows_of(shown.any(0)) <= _rows_in(kv_runs), (context, block)
                        assert _rows_of(shown.any(1)) <= _rows_in(q_runs), (context, block)


def test_runtime_terms_travel_their_static_part():
    for mask in (CAUSAL_SPEC & DOCS, CAUSAL_SPEC & PAD, CAUSAL_SPEC & SlidingWindow(2) & DOCS & PAD):
        for queries_travel in (False, True):
            assert travelling_rows(queries_travel, "zigzag", mask, 0, 1, 4, 2) == travelling_rows(
                queries_travel, "zigzag", mask.static_part, 0, 1, 4, 2)


def test_pairs_the_data_hide_move_nothing():
    """Documents aligned with contiguous shards: every pair of different ranks is hidden (in every batch
    row) and nothing travels; one document across shards 1 and 2 keeps that pair; keys all padded on a
    rank in every batch row hide its pairs as senders."""
    mask, local_len, world_size = CAUSAL_SPEC & DOCS, 4, 4
    doc_ids = torch.arange(16).div(4, rounding_mode="floor").repeat(2, 1)
    everything = {(q, kv) for q in range(4) for kv in range(4) if q != kv}
    causal_pairs = {(q, kv) for q, kv in everything if kv < q}
    assert pairs_hidden_by_data("contiguous", mask, local_len, world_size, doc_ids) == causal_pairs
    assert pairs_hidden_by_data("contiguous", mask, local_len, world_size, doc_ids, rank=1) == {(2, 1), (3, 1), (1, 0)}
    transfers = planner.predicted_transfers("contiguous", CAUSAL_SPEC, 16, 4, 2, 4, 2, 8, 2, frozenset(causal_pairs))
    assert all(sum(t.sent) == 0 for t in transfers.values())
    doc_ids[:, 8] = 1  # shard 2's first token continues document 1 (shard 1's)
    assert pairs_hidden_by_data("contiguous", mask, local_len, world_size, doc_ids) == causal_pairs - {(2, 1)}
    key_valid = torch.ones(2, 16, dtype=torch.bool)
    key_valid[:, 4:8] = False  # rank 1's keys are padding in both rows
    padded = pairs_hidden_by_data("contiguous", CAUSAL_SPEC & PAD, local_len, world_size, key_valid_BS=key_valid)
    assert padded == {(2, 1), (3, 1)}
    key_valid[1, 5] = True  # one real key in one batch row: the pair is needed
    assert not pairs_hidden_by_data("contiguous", CAUSAL_SPEC & PAD, local_len, world_size, key_valid_BS=key_valid)


def test_per_row_formulas_times_a_shard_are_the_dense_formulas():
    s = planner.S / planner.P
    assert sympy.simplify(planner.FORWARD_BYTES_PER_STEP - s * planner.FORWARD_BYTES_PER_KV_ROW) == 0
    for plan, rows in (("kv_ring", planner.KV_RING_BYTES_PER_KV_ROW), ("burst", planner.BURST_BYTES_PER_Q_ROW)):
        assert sympy.simplify(planner.BACKWARD_BYTES_PER_STEP[plan] - s * (rows["out"] + rows["back"])) == 0


SHAPE = dict(batch=2, heads_q=4, heads_kv=2, head_dim=8, dtype=torch.bfloat16)


def _transfers(layout, mask, seq_len, world_size, shape=SHAPE, hidden_pairs=frozenset(), rows_between=None):
    return planner.predicted_transfers(layout, mask, seq_len, world_size, shape["batch"], shape["heads_q"],
                                       shape["heads_kv"], shape["head_dim"], shape["dtype"], hidden_pairs,
                                       rows_between=rows_between)


def _bound(layout, mask, seq_len, world_size, shape=SHAPE):
    return planner.zero_redundancy_bound(layout, mask, seq_len, world_size, shape["batch"], shape["heads_q"],
                                         shape["heads_kv"], shape["head_dim"], shape["dtype"])


@pytest.mark.parametrize("layout", layouts.LAYOUTS)
@pytest.mark.parametrize("world_size", [2, 3, 4, 8])
def test_every_rank_receives_exactly_the_zero_redundancy_bound(layout, world_size):
    """For every static mask kind each rank receives what it must and nothing more (ratio 1.0 <= 1.05),
    sent and received balance over the ring, and full attention sends the dense formula every step."""
    local_len = 8
    seq_len = local_len * world_size
    for name, mask in static_masks(local_len).items():
        transfers, bound = _transfers(layout, mask, seq_len, world_size), _bound(layout, mask, seq_len, world_size)
        for op in ("forward", "kv_ring", "burst"):
            context = (name, op)
            assert transfers[op].received == bound[op], context
            assert planner.over_bound(transfers[op].received, bound[op]) == 1.0, context
            assert sum(transfers[op].sent) == sum(transfers[op].received), context
    dense = planner.plan_attention(2, seq_len, world_size, 4, 2, 8, torch.bfloat16)
    full = _transfers(layout, MaskSpec.full(), seq_len, world_size)
    for rank_steps in full["forward"].sent_per_step:
        assert list(rank_steps) == [dense.predicted_bytes["forward"]] * (world_size - 1) + [0]
    for plan in ("kv_ring", "burst"):
        per_call = planner._bytes(planner.BACKWARD_BYTES_PER_CALL[plan], (2, seq_len, world_size, 4, 2, 8, 2))
        assert full[plan].sent == (per_call,) * world_size == full[plan].received


@pytest.mark.parametrize("world_size", [4, 8, 16])
def test_a_window_within_a_shard_sends_at_most_one_over_p_minus_1_of_dense_causal(world_size):
    """Dense causal: the ring's bytes per rank for causal attention without skipping (the planner's
    dense formulas; also what the mask-aware zigzag forward's busiest rank sends)."""
    seq_len = 64 * world_size
    dense = planner.plan_attention(2, seq_len, world_size, 4, 2, 8, torch.bfloat16)
    dense_causal = {"forward": dense.total_bytes["forward"], "kv_ring": dense.total_bytes["backward"],
                    "burst": dense.alternative_total_bytes["backward"]}
    assert dense.plan == "kv_ring"
    assert max(_transfers("zigzag", CAUSAL_SPEC, seq_len, world_size)["forward"].sent) == dense_causal["forward"]
    for layout, widths in (("contiguous", (1, 16, 63, 64)), ("zigzag", (1, 16, 32))):  # w <= S/P (S/2P for zigzag)
        for window in widths:
            mask = CAUSAL_SPEC & SlidingWindow(window - 1)
            transfers = _transfers(layout, mask, seq_len, world_size)
            for op in ("forward", "kv_ring", "burst"):
                for direction in ("sent", "received"):
                    mine = max(getattr(transfers[op], direction))
                    assert mine * (world_size - 1) <= dense_causal[op], (layout, window, op, direction, mine)


@pytest.mark.parametrize("world_size", [2, 4, 8])
def test_zigzag_causal_moves_three_quarters_of_the_dense_ring(world_size):
    """The mask-blind ring sends every rank's K/V to every other rank; causal zigzag needs only the head
    chunk where the receiver is later: 1/4 of the traffic was waste (MagiAttention's figure)."""
    seq_len = 16 * world_size
    transfers = _transfers("zigzag", CAUSAL_SPEC, seq_len, world_size)
    dense = _transfers("zigzag", MaskSpec.full(), seq_len, world_size)
    assert sum(transfers["forward"].sent) * 4 == sum(dense["forward"].sent) * 3


def test_bound_counts_global_visibility_by_hand():
    """Contiguous, P = 3, 4 tokens per rank, window of 2 (HF sliding_window=3): rank r > 0 needs the last
    2 keys of rank r - 1, nothing else."""
    mask = CAUSAL_SPEC & SlidingWindow(2)
    row = 2 * SHAPE["batch"] * SHAPE["heads_kv"] * SHAPE["head_dim"] * 2  # K and V, bf16
    assert _bound("contiguous", mask, 12, 3)["forward"] == (0, 2 * row, 2 * row)
    assert _transfers("contiguous", mask, 12, 3)["forward"].sent_per_step == ((2 * row, 0, 0), (2 * row, 0, 0),
                                                                              (0, 0, 0))


def test_simulator_cli_prints_one_row_per_layout(capsys):
    balance.main(["--mask", "causal", "window:16", "--P", "4", "--S", "256", "--layout", "contiguous", "zigzag"])
    rows = [line for line in capsys.readouterr().out.splitlines() if line.startswith("| causal")]
    assert len(rows) == 4
    by_key = {tuple(cell.strip() for cell in row.split("|")[1:3]): row for row in rows}
    window = by_key[("causal&window(15,-)", "contiguous")].split("|")
    assert float(window[7]) == float(window[10]) == 1.0 and float(window[11]) <= 1 / 3  # bound ratios; / dense


# ---------------------------------------------------------------------------------------------
# The op on gloo worker groups

HEADS_Q, HEADS_KV, HEAD_DIM, BATCH = 4, 2, 8, 2
COMPARED = ("out", "dq", "dk", "dv")


def _masks(local_len: int) -> dict[str, MaskSpec]:
    return {**static_masks(local_len), "documents": CAUSAL_SPEC & DOCS, "padding": CAUSAL_SPEC & PAD,
            "window&documents&padding": CAUSAL_SPEC & SlidingWindow(local_len) & DOCS & PAD}


def _mask_data(mask: MaskSpec, seq_len: int, seed: int) -> dict:
    """The shared runtime data, with batch row 1 right-padded too (its last quarter): the last keys are padding in
    every batch row, so their rows need not travel."""
    data = runtime_mask_data(mask, BATCH, seq_len, seed, doc_start_probability=0.3)
    if data["key_valid"] is not None:
        data["key_valid"][1, seq_len - max(1, seq_len // 4):] = False
    return data


def _run_grid(rank, world_size, grid):
    """Worker task: per case, max errors vs fp32 SDPA with the dense mask, and the call counters."""
    results = []
    for index, (layout, local_len, name, plan) in enumerate(grid):
        seq_len = local_len * world_size
        mask = _masks(local_len)[name]
        data = _mask_data(mask, seq_len, index)
        errors, stats = ring_attention_case(rank, world_size, mask, layout, plan, seq_len,
                                            (BATCH, HEADS_Q, HEADS_KV, HEAD_DIM), data, 2000 + index)
        counters = {call.op: (call.plan, call.bytes_sent_per_step, call.bytes_received_per_step, call.work_per_step)
                    for call in stats.calls}
        results.append(((layout, local_len, name, plan), errors, counters))
    return results


def _grid():
    grid = []
    for layout in layouts.LAYOUTS:
        local_len = 6 if layout == "zigzag" else 5
        for i, name in enumerate(sorted(_masks(local_len))):
            for plan in ra.PLANS:
                grid.append((layout, local_len, name, plan))
    return grid


@pytest.mark.multirank
@pytest.mark.parametrize("world_size", [2, 4])
def test_counters_equal_prediction_and_bound_and_results_stay_exact(workers, world_size):
    per_rank = workers.get(world_size).run(_run_grid, _grid())
    fp32 = dict(SHAPE, dtype=torch.float32)
    checked = skipped_padding = 0
    hidden_somewhere = 0
    for rank, results in enumerate(per_rank):
        for index, ((layout, local_len, name, plan), errors, counters) in enumerate(results):
            context = (rank, layout, name, plan)
            for key in COMPARED:
                allowed = tolerance(torch.float32, f"attention_{key}")
                diff, scale = errors[key]
                assert diff <= allowed.atol + allowed.rtol * scale, (context, key, diff, scale)
            mask, seq_len = _masks(local_len)[name], local_len * world_size
            data = _mask_data(mask, seq_len, index)
            hidden = pairs_hidden_by_data(layout, mask, local_len, world_size, data["doc_ids"], data["key_valid"])
            hidden_somewhere += bool(hidden)
            # with the data: hidden pairs move nothing, packed documents only their trimmed blocks' rows
            data_rows = balance.data_rows(layout, mask, local_len, world_size, data["doc_ids"], data["key_valid"])
            transfers = _transfers(layout, mask.static_part, seq_len, world_size, fp32, hidden, data_rows)
            bound = _bound(layout, mask.static_part, seq_len, world_size, fp32)
            simulated = balance.simulate(mask, layout, world_size, seq_len, batch=BATCH, heads_q=HEADS_Q,
                                         heads_kv=HEADS_KV, head_dim=HEAD_DIM, dtype=torch.float32, plan=plan, **data)
            for op, key in (("forward", "forward"), ("backward", plan)):
                got_plan, sent, received, work = counters[op]
                assert list(sent) == list(transfers[key].sent_per_step[rank]), (context, op)
                assert list(received) == list(transfers[key].received_per_step[rank]), (context, op)
                assert simulated.transfers[key].sent_per_step[rank] == tuple(sent), (context, op)
                if not mask.runtime_terms:  # with data, the counter counts what the data leave visible
                    assert sum(received) == bound[key][rank], (context, op)
                    assert sum(work) == simulated.work_by_op[key][rank], (context, op)
                else:  # the static part's bound, less what the data hide
                    assert sum(received) <= bound[key][rank], (context, op)
                    assert sum(work) <= simulated.work_by_op[key][rank], (context, op)
                    # K/V rows that are padding in every batch row stay home: padding alone receives exactly
                    # the data's bound (every K/V row some query sees, once), in the forward and the kv_ring
                    if name == "padding" and key != "burst":
                        grouped = balance.batch_groups_bound(layout, mask, seq_len, world_size, BATCH, HEADS_Q,
                                                             HEADS_KV, HEAD_DIM, torch.float32, **data)
                        assert sum(received) == grouped[key][rank] >= simulated.bound[key][rank], (context, op)
                        skipped_padding += bound[key][rank] - sum(received)
                    else:  # packed documents (sorted ids) send only their trimmed blocks' rows
                        assert (sum(received) == bound[key][rank]) or hidden or mask.term(Documents) or \
                            mask.term(KeyPadding), (context, op)
            assert counters["backward"][0] == plan
            checked += 1
    assert checked == world_size * len(_grid())
    assert skipped_padding > 0  # some padded K/V rows stayed home
    assert hidden_somewhere or world_size == 2  # on 4 ranks, the pairs the documents hide are skipped


@pytest.mark.multirank
def test_a_short_window_sends_only_halos_on_the_wire(workers):
    """Contiguous, P = 4, a window of 1 on shards of 5: each rank receives 1 key row from its left
    neighbour (and, in the kv_ring backward, their dK/dV back), rank 0 nothing; nothing else moves."""
    grid = [("contiguous", 5, "window_lt_shard", "kv_ring")]
    assert static_masks(5)["window_lt_shard"] == CAUSAL_SPEC & SlidingWindow(1)
    row = 2 * BATCH * HEADS_KV * HEAD_DIM * 4  # K and V, fp32
    for rank, [(_, _, counters)] in enumerate(workers.get(4).run(_run_grid, grid)):
        forward_received = counters["forward"][2]
        assert forward_received == ([0, 0, 0, 0] if rank == 0 else [1 * row, 0, 0, 0]), rank
        forward_sent = counters["forward"][1]
        assert forward_sent == ([0, 0, 0, 0] if rank == 3 else [1 * row, 0, 0, 0]), rank


def _compiled_window_model(rank, world_size, layout):
    """Worker task: Mistral with a window of 8 (shorter than a 16-token shard) compiled on the mesh; the
    report's attention details and the ring calls' counters of one training step."""
    import burstc
    from burstc.testing import zoo
    from torch.distributed.device_mesh import init_device_mesh

    torch._dynamo.reset()
    model = zoo.hf_arch_variant("MistralConfig", "sdpa", sliding_window=8)
    cmodel = burstc.compile(model, init_device_mesh("cpu", (world_size,)), backend="aot_eager", layout=layout)
    with ra.record_stats() as stats:
        zoo.hf_loss_no_cache(cmodel, zoo.hf_arch_inputs()).backward()
    details = [r.details for r in burstc.report(cmodel).rewrites if r.kind == "attention"]
    calls = [(c.op, c.total_bytes_sent, c.total_bytes_received) for c in stats.calls]
    return details, calls


@pytest.mark.slow  # ~1 min: compiles a 2-layer HF model on 2 ranks
@pytest.mark.multirank
def test_report_shows_predicted_bytes_bound_and_ratio_per_attention(workers):
    pytest.importorskip("transformers")
    per_rank = workers.get(2).run(_compiled_window_model, "contiguous")
    details = per_rank[0][0]
    assert len(details) == 2
    for detail in details:
        assert detail["mask"].startswith("causal&window(7,-)"), detail
        assert detail["bytes_over_bound"] == {"forward": 1.0, "backward": 1.0}, detail
        # the busiest rank's counters are the prediction; what the ranks receive is the bound
        for op in ("forward", "backward"):
            sent = [c[1] for calls in per_rank for c in calls[1] if c[0] == op]
            received = [c[2] for calls in per_rank for c in calls[1] if c[0] == op]
            assert max(sent) == detail["predicted_bytes"][op], (op, sent, detail)
            assert max(received) == detail["bytes_bound"][op], (op, received, detail)
            assert 0 < max(sent) < (1 if op == "forward" else 3) * 2 * 16 * 2 * 8 * 4  # less than one dense shard
