"""burstc.memory: the measurement helper sees known allocations; the model's saved activations are what the
compiled forward actually saves (counted with saved-tensor hooks at run time); ``memory_budget=`` picks the
checkpoint mode its predictions say, and (slow) the predictions are within 15% of measured peaks and the
measured peak does not rise as the budget falls."""
import operator

import pytest
import torch

import burstc
import burstc.memory
from burstc.memory import BUDGET_MODES, PLANNED_MODES, exact_cpu_peaks, measure_peak
from burstc.testing import zoo

MIB = 2**20


def test_measure_peak_sees_a_known_allocation():
    exact_cpu_peaks()
    with measure_peak("cpu") as peak:
        tensor = torch.ones(64 * MIB // 4)
        del tensor
    assert 62 * MIB <= peak.extra_bytes <= 68 * MIB, peak
    assert peak.baseline_bytes > 0 and peak.peak_bytes >= peak.baseline_bytes + peak.extra_bytes - 1


def test_measure_peak_counts_only_what_the_region_adds():
    resident = torch.ones(64 * MIB // 4)
    with measure_peak("cpu") as peak:
        tensor = torch.ones(16 * MIB // 4)
        del tensor
    assert 14 * MIB <= peak.extra_bytes <= 20 * MIB, peak
    del resident


@pytest.mark.parametrize("bad", [0, -1, True, 1.5, "4GiB"])
def test_memory_budget_must_be_positive_bytes(bad):
    with pytest.raises(ValueError, match="memory_budget"):
        burstc.BurstConfig(memory_budget=bad)


def test_memory_budget_and_explicit_checkpoint_conflict():
    with pytest.raises(ValueError, match="conflict"):
        burstc.BurstConfig(memory_budget=2**30, checkpoint="layers")
    assert burstc.BurstConfig(memory_budget=2**30).memory_budget == 2**30


def _saved_storages(cmodel, model, inputs) -> int:
    """Bytes of the distinct storages the compiled forward saves for its backward, at run time (saved-tensor
    hooks), other than the parameters', buffers' and inputs'."""
    resident = {t.untyped_storage().data_ptr() for t in [*model.parameters(), *model.buffers(), *inputs]}
    saved = {}

    def pack(t):
        storage = t.untyped_storage()
        if storage.data_ptr() not in resident:
            saved[storage.data_ptr()] = storage.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = cmodel(*inputs)
    loss.backward()
    return sum(saved.values()), loss.untyped_storage().nbytes()


def saved_bytes_task(rank, world_size, options):
    """Per checkpoint option: (bytes saved at run time, the model's saved bytes, the loss's bytes, the report,
    the predicted peak)."""
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (world_size,)) if world_size > 1 else None
    found = {}
    for label, opts in options.items():
        torch._dynamo.reset()
        model = zoo.titan_llama()
        cmodel = burstc.compile(model, mesh, backend="aot_eager", **opts)
        inputs = zoo.titan_inputs()
        cmodel(*inputs).backward()  # compiles
        model.zero_grad(set_to_none=True)
        saved, loss_bytes = _saved_storages(cmodel, model, inputs)
        report = burstc.report(cmodel)
        estimate = report.memory
        with_adamw = burstc.memory.predict_step(report, optimizer="adamw")
        parameter_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
        found[label] = (saved, estimate.saved_total, loss_bytes, str(report), estimate.peak,
                        (estimate.parameters, parameter_bytes, with_adamw.peak - estimate.peak))
    return found


def _assert_saved_match(found):
    for label, (saved, predicted, loss_bytes, *_) in found.items():
        assert saved > 0, label
        # the model also counts the loss the forward returns (live through the backward, not saved)
        assert predicted == saved + loss_bytes, (label, saved, predicted)


def test_saved_activations_match_the_runtime_on_one_device():
    found = saved_bytes_task(0, 1, {"one device": {}})
    _assert_saved_match(found)
    assert "memory (predicted per rank, one training step): peak" in found["one device"][3]
    counted, parameter_bytes, adamw_state = found["one device"][5]
    assert counted == parameter_bytes and adamw_state == 2 * parameter_bytes  # exp_avg and exp_avg_sq


def test_summary_says_which_order_an_inductor_graph_was_replayed_in():
    from burstc.memory import predict_graphs

    def f(x, w):
        return ((x @ w).relu().sum(0),)

    gm = torch.fx.experimental.proxy_tensor.make_fx(f)(torch.randn(8, 4), torch.randn(4, 4))
    for node in gm.graph.nodes:  # make_fx recorded the values; the replay reads node.meta["val"]
        assert "val" in node.meta or node.op == "output"
    seen = predict_graphs([(gm, gm, 1)], backend="inductor", schedules=[{"forward": {"mm": 0, "relu": 1}}])
    unseen = predict_graphs([(gm, gm, 1)], backend="inductor")
    assert seen.scheduled and not unseen.scheduled
    assert "Inductor's kernel order" in seen.summary() and "FX graphs' order" in unseen.summary()
    assert "order" not in predict_graphs([(gm, gm, 1)], backend="aot_eager").summary()


def test_budget_refines_the_kept_fraction_between_grid_points(monkeypatch):
    """memory_budget's kept fraction: the grid (1.0, 0.75, 0.5, 0.25) brackets the largest that fits, bisection
    refines it; with a peak linear in the fraction, the choice is the largest fraction on the 1/32 grid that fits."""
    import burstc.kept_rows
    import burstc.memory as memory

    current = {}  # the mode being planned: _mode_tags gets its base, keep_attention_rows its fraction

    def tags(joint, base):
        current.update(base=base, keep=None)
        return joint

    def keep_rows(forward, backward, keep, num_fwd_outputs, world_size):
        current["keep"] = keep
        return ()

    def predict(records, **kwargs):  # none 500, selective 100 + 200 x kept fraction, layers 90
        base, keep = current["base"], current["keep"]
        peak = {"none": 500, "layers": 90}.get(base, 100 + 200 * (1.0 if keep is None else keep))
        return memory.MemoryEstimate(step_peak=int(peak))

    monkeypatch.setattr(memory, "_mode_tags", tags)
    monkeypatch.setattr(memory, "predict_graphs", predict)
    monkeypatch.setattr(burstc.kept_rows, "retag_for_recompute", lambda tagged: True)
    monkeypatch.setattr(burstc.kept_rows, "keep_attention_rows", keep_rows)

    def plan(budget):
        return memory.partition_within_budget(lambda tagged, inputs, **kw: ("fw", "bw"), None, None,
                                              {"num_fwd_outputs": 1}, budget=budget, backend="aot_eager",
                                              world_size=2, parameters=0, buffers=0, graph_id=0)[1]

    # 260 fits kept <= 0.8: grid 0.75 fits, 1.0 not; bisection 0.875 (275, over), 0.8125 (262, over), 0.78125 (256)
    chosen = plan(260)
    assert chosen.fits and chosen.mode == "selective:0.78125" and chosen.predicted[chosen.mode] == 256
    assert list(chosen.predicted) == ["none", "selective", "selective:0.75", "selective:0.875", "selective:0.8125",
                                      "selective:0.78125"]
    assert "checkpoint_keep=0.78125" in chosen.summary()
    assert plan(1000).mode == "none" and plan(300).mode == "selective"  # no refinement when a grid mode fits first
    assert plan(95).mode == "layers"  # below every fraction: no refinement either
    assert plan(10).mode == "layers" and not plan(10).fits  # nothing fits: the least memory


def test_unknown_optimizer_is_an_error():
    from burstc.memory import predict_graphs

    with pytest.raises(ValueError, match="optimizer"):
        predict_graphs([], backend="aot_eager", optimizer="lion")


@pytest.fixture(scope="module")
def modes_on_two_ranks(workers):
    """saved_bytes_task of the three checkpoint modes on 2 ranks, per rank (run once for the module)."""
    return workers.get(2).run(saved_bytes_task, {mode: mode_options(mode) for mode in PLANNED_MODES})


def mode_options(mode):
    """A planned mode (``"selective:0.5"``) as burstc.compile options."""
    base, _, keep = mode.partition(":")
    return {"checkpoint": base} | ({"checkpoint_keep": float(keep)} if keep else {})


def test_saved_activations_match_the_runtime_in_every_mode(modes_on_two_ranks):
    for found in modes_on_two_ranks:
        _assert_saved_match(found)
        saved = {label: v[0] for label, v in found.items()}
        # layers keep their inputs only; selective keeps the ring attention's output and LSE too, half of it with
        # checkpoint_keep=0.5
        assert saved["layers"] < saved["selective:0.25"] < saved["selective:0.5"] < saved["selective:0.75"] \
            < saved["selective"] < saved["none"], saved
        assert saved["selective:0.5"] - saved["layers"] == (saved["selective"] - saved["layers"]) // 2, saved


def budget_task(rank, world_size, build, inputs_fn, seq_len, budgets, measure, direct_modes=PLANNED_MODES):
    """Per budget (bytes, or ``(weight of the lowest, middle, highest)`` mode peak, the modes compiled first):
    the mode memory_budget= chose, whether it fits, each mode's predicted peak under the budget, the chosen
    mode's predicted peak and, with ``measure``, its measured step peak; and per mode compiled directly
    (``checkpoint=``) its (predicted peak, predicted step peak, measured step peak)."""
    from torch.distributed.device_mesh import init_device_mesh

    if measure:
        exact_cpu_peaks()
    mesh = init_device_mesh("cpu", (world_size,))

    def step(**options):
        torch._dynamo.reset()
        model = build()
        cmodel = burstc.compile(model, mesh, backend="aot_eager", **options)
        inputs = inputs_fn(seq_len)
        cmodel(*inputs).backward()
        model.zero_grad(set_to_none=True)
        measured = 0
        if measure:
            torch.distributed.barrier()
            with measure_peak("cpu") as peak:
                cmodel(*inputs).backward()
            measured = peak.extra_bytes
        return burstc.report(cmodel), measured

    modes = {}
    if any(isinstance(b, tuple) for b in budgets):
        for mode in direct_modes:
            report, measured = step(**mode_options(mode))
            modes[mode] = (report.memory.peak, report.memory.step_peak, measured)
    peaks = sorted(modes[m][0] for m in BUDGET_MODES if m in modes)  # a budget (weights) places itself among these
    chosen = []
    for budget in budgets:
        if isinstance(budget, tuple):
            budget = int(sum(w * p for w, p in zip(budget, peaks)))
        report, measured = step(memory_budget=budget)
        (plan,) = report.memory_plans
        chosen.append((budget, plan.mode, plan.fits, plan.predicted, report.memory.peak, measured))
    return modes, chosen


def small_llama():
    torch.manual_seed(0)
    from burstc.testing.zoo.titan import TitanLlama, TitanLlamaArgs, WithLoss

    return WithLoss(TitanLlama(TitanLlamaArgs(dim=64, n_layers=2, n_heads=4, n_kv_heads=4, vocab_size=256,
                                              max_seq_len=1024)))


def llama_inputs(seq_len, vocab=256):
    ids = torch.randint(0, vocab, (1, seq_len + 1), generator=torch.Generator().manual_seed(1))
    return ids[:, :-1], ids[:, 1:]


def _check_choices(chosen, direct_peaks):
    """Each budget ran the first mode in recompute order whose predicted peak fits, else the least memory;
    a mode's prediction under the budget is that of compiling it directly (within 5%)."""
    for budget, mode, fits, predicted, peak, _ in chosen:
        fitting = [m for m in PLANNED_MODES if m in predicted and predicted[m] <= budget]
        assert fits == bool(fitting) and peak == predicted[mode]
        if mode not in PLANNED_MODES:  # a kept fraction refined between the first grid fraction that fits and the
            grid = fitting[0]            # mode before it, which did not
            before = PLANNED_MODES[PLANNED_MODES.index(grid) - 1]
            upper = 1.0 if before == "selective" else float(before.partition(":")[2])
            assert grid.startswith("selective:") and float(grid[10:]) < float(mode[10:]) < upper, (mode, predicted)
            assert predicted[mode] <= budget, (mode, budget, predicted)
            continue
        assert mode == (fitting[0] if fitting else min(predicted, key=predicted.get)), (budget, predicted)
        for m, p in predicted.items():
            if m in direct_peaks:  # the modes compiled directly
                assert abs(p - direct_peaks[m]) <= 0.05 * direct_peaks[m], (m, p, direct_peaks)


def test_memory_budget_picks_the_mode_that_fits(workers, modes_on_two_ranks):
    found = modes_on_two_ranks[0]
    peaks = {mode: found[mode][4] for mode in PLANNED_MODES}
    low = min(peaks["selective"], peaks["layers"])
    assert peaks["none"] > max(peaks["selective"], peaks["layers"]), peaks
    budgets = [2 * peaks["none"], (peaks["none"] + max(peaks["selective"], peaks["layers"])) // 2, low // 2]
    for _, chosen in workers.get(2).run(budget_task, zoo.titan_llama, titan_inputs_any_length, 0, budgets, False):
        _check_choices(chosen, peaks)
        assert [(c[1], c[2]) for c in chosen] == [
            ("none", True), ("selective" if peaks["selective"] <= budgets[1] else "layers", True),
            (min(PLANNED_MODES[1:], key=peaks.get), False)], chosen


def titan_inputs_any_length(seq_len):
    return zoo.titan_inputs()


def benchmark_llama():
    torch.manual_seed(0)
    from burstc.testing.zoo.titan import TitanLlama, TitanLlamaArgs, WithLoss

    return WithLoss(TitanLlama(TitanLlamaArgs(dim=256, n_layers=4, n_heads=4, n_kv_heads=4, vocab_size=4096,
                                              max_seq_len=2049)))


def benchmark_inputs(seq_len):
    return llama_inputs(seq_len, vocab=4096)


@pytest.mark.slow
def test_predictions_within_15_percent_and_peak_monotone_in_budget(workers):
    """The benchmark's model at S = 2048 on 2 ranks (benchmarks/memory_model.py runs longer sequences): every
    mode's predicted step peak within 15% of the measured one; along a falling budget sweep the chosen modes
    are those predicted and the measured peak never rises."""
    # above every mode, between the two lowest (a kept fraction refined), below all (nothing fits); a budget
    # between the top two is swept on the small model (test_memory_budget_picks_the_mode_that_fits)
    budgets = [(0, 0, 2), (0.5, 0.5, 0), (0.5, 0, 0)]
    # the three modes and one kept fraction compiled directly (all six took over 2 minutes on a loaded machine)
    for modes, chosen in workers.get(2).run(budget_task, benchmark_llama, benchmark_inputs, 2048, budgets, True,
                                            BUDGET_MODES + ("selective:0.5",), timeout=600):
        for mode, (_, step_peak, measured) in modes.items():
            assert abs(step_peak / measured - 1) <= 0.15, (mode, step_peak, measured)
        _check_choices(chosen, {mode: peak for mode, (peak, _, _) in modes.items()})
        measured = [c[5] for c in chosen]
        # selective and layers differ by ~3% here (predicted 71.4 vs 69.4 MiB): allow the measurement's own
        # spread between runs of one mode (~3% under load, seen in CI) on top of "never rises"
        assert all(later <= earlier * 1.05 for earlier, later in zip(measured, measured[1:])), chosen
        assert measured[-1] < measured[0] * 0.7, chosen  # and the sweep's end is well below its start


def test_replay_frees_at_last_use_and_views_share_storage():
    from torch.fx.experimental.proxy_tensor import make_fx

    from burstc.memory import _Storages, replay

    def f(x):
        a = x * 2                    # 4 KiB, used by the view's users
        b = a.view(32, 32)           # no allocation
        c = b + 1                    # 4 KiB: a and c live together, the peak
        d = c.sum()                  # 4 B; a and c freed after their last uses
        return d * x.sum()

    gm = make_fx(f)(torch.randn(1024))
    result, returned = replay(gm, _Storages(), "f")
    assert result.peak_bytes == 2 * 4096 and result.peak_node.startswith("add")
    assert result.end_bytes == 4  # only the output survives
    assert len(returned) == 1


def test_replay_follows_inductor_buffers_and_their_last_kernel():
    """Under a kernel schedule, a value Inductor fused away takes no memory, and a buffer lives until the last
    kernel reading it (a fused kernel that recomputes a pointwise op reads that op's input)."""
    from torch.fx.experimental.proxy_tensor import make_fx

    from burstc.memory import KernelSchedule, _Storages, replay

    def f(x, w):
        y = x @ w                    # 64 KiB, a buffer (extern matmul)
        z = y.relu()                 # fused away: recomputed from y by the kernels that read it
        u = z * 3                    # 64 KiB, a buffer
        v = u.sum()
        return v + z.sum()           # last kernel: reads y (recomputing z)

    gm = make_fx(f)(torch.randn(128, 32), torch.randn(32, 128))
    names = [n.name for n in gm.graph.nodes if n.op == "call_function"]
    assert names == ["mm", "relu", "mul", "sum_1", "sum_2", "add"]
    plain, _ = replay(gm, _Storages(), "f", schedule={"mm": 0, "relu": 1, "mul": 1, "sum_1": 2, "sum_2": 3, "add": 3})
    schedule = KernelSchedule()
    schedule.update({"mm": 0, "relu": 1, "mul": 1, "sum_1": 2, "sum_2": 3, "add": 3})
    schedule.materialized |= {"mm", "mul", "sum_1", "add"}
    schedule.last_reads.update({"mm": 3, "mul": 2, "sum_1": 3})
    kernels, _ = replay(gm, _Storages(), "f", schedule=schedule)
    buffer = 128 * 128 * 4
    # FX: y dies after relu, z lives to sum_2; Inductor: z has no buffer, y lives until the last kernel (which
    # reads it to recompute z), u until sum_1; both peak at sum_1 with two buffers
    assert plain.peak_bytes == kernels.peak_bytes == 2 * buffer + 4
    assert {key[1] for key in plain.live_at_peak} == {"relu", "mul", "sum_1"}
    assert {key[1] for key in kernels.live_at_peak} == {"mm", "mul", "sum_1"}
    # read last by kernel 1 (relu and mul fused), y is gone before sum_1: the peak is y and u at mul
    schedule.last_reads["mm"] = 1
    early, _ = replay(gm, _Storages(), "f", schedule=schedule)
    assert early.peak_bytes == 2 * buffer and early.peak_node == "mul"


def test_inductor_schedule_records_buffers_and_last_reads():
    from torch._inductor.compile_fx import compile_fx_inner
    from torch.fx.experimental.proxy_tensor import make_fx

    from burstc.memory import inductor_schedule

    def f(x, w):
        y = x @ w
        return ((y.relu() * 3).sum(0) + y.sum(0),)

    inputs = [torch.randn(64, 32), torch.randn(32, 64)]
    traced = make_fx(f)(*inputs)
    with torch._inductor.config.patch(fx_graph_cache=False), inductor_schedule() as schedule:
        compile_fx_inner(traced, inputs)
    assert "mm" in schedule.materialized and "relu" not in schedule.materialized  # relu fused into its reader
    assert schedule.last_reads["mm"] >= schedule["mm"] and schedule.last_reads["mm"] >= schedule["relu"]
    inputs_named = {n.name for n in traced.graph.nodes if n.op == "placeholder"}
    assert inputs_named <= set(schedule.last_reads)  # graph inputs, by their FX names


def test_two_level_rings_add_their_buffers_to_the_flat_rings():
    from burstc.memory import two_level_ring_buffers

    q, k = torch.empty(1, 4, 8, 16), torch.empty(1, 2, 8, 16)
    shard_q, shard_kv, lse = 4 * 8 * 16 * 4, 2 * 8 * 16 * 4, 4 * 8 * 4
    assert two_level_ring_buffers(["flat"], q, k, None, backward=False) == 0
    assert two_level_ring_buffers(["inter", "intra"], q, k, None, backward=False) == 2 * 2 * shard_kv
    assert two_level_ring_buffers(["inter", "intra"], q, k, "burst", backward=True) == \
        2 * (2 * shard_q + 2 * lse) + 2 * shard_q
    assert two_level_ring_buffers(["ulysses", "intra", "inter"], q, k, None, backward=False) == \
        2 * (2 * shard_q + 2 * shard_kv + lse)


def test_scheduled_order_follows_the_schedule_and_stays_topological():
    from burstc.memory import scheduled_order

    def f(x):
        a = x + 1
        b = x * 2
        view = a.view(-1)
        return view.sum() + b.sum()

    gm = torch.fx.symbolic_trace(f)
    names = lambda order: [n.name for n in order]  # noqa: E731
    assert scheduled_order(gm, None) == list(gm.graph.nodes)
    # b first, then a: the view of a follows a, and every node still follows its inputs
    order = scheduled_order(gm, {"mul": 0, "add": 1, "sum_1": 2, "sum_2": 3, "add_1": 4})
    assert names(order)[:3] == ["x", "mul", "add"] and names(order).index("view") == 3
    seen = set()
    for node in order:
        assert all(arg in seen for arg in node.all_input_nodes), names(order)
        seen.add(node)
    assert len(order) == len(gm.graph.nodes)


def test_inductor_schedule_names_the_graphs_nodes():
    from burstc.memory import inductor_schedule

    def f(x, w):
        return (torch.relu(x @ w).sum(0) * 2,)

    gm = torch.fx.symbolic_trace(f)
    from torch._inductor.compile_fx import compile_fx_inner
    from torch.fx.experimental.proxy_tensor import make_fx

    inputs = [torch.randn(8, 4), torch.randn(4, 4)]
    traced = make_fx(gm)(*inputs)
    with torch._inductor.config.patch(fx_graph_cache=False), inductor_schedule() as schedule:
        compile_fx_inner(traced, inputs)
    computing = {n.name for n in traced.graph.nodes if n.op == "call_function"}
    assert schedule and set(schedule) <= computing | {n.name for n in traced.graph.nodes}
    assert any(name.startswith("mm") for name in schedule), schedule  # the matmul is its own (extern) kernel


def test_report_warns_when_inductor_peaks_above_a_budget_the_fx_order_fit(monkeypatch):
    """memory_budget chooses before Inductor compiles (FX order); the report replays Inductor's kernels after, and
    says when that peak is over the budget."""
    from burstc.memory import MemoryEstimate, MemoryPlan
    from burstc.report import Report

    report = Report(burstc.BurstConfig(), world_size=2)
    report.new_graph().graphs["backward"] = torch.fx.GraphModule(torch.nn.Module(), torch.fx.Graph())
    report.memory_plans = [MemoryPlan(0, 100 * 2**20, "selective", {"selective": 90 * 2**20}, fits=True)]
    estimate = MemoryEstimate(step_peak=120 * 2**20, backend="inductor", scheduled=True)
    monkeypatch.setattr(Report, "memory", property(lambda self: estimate))
    line = report.budget_check_line()
    assert line.startswith("warning: memory_budget 100.0 MiB per rank") and "120.0 MiB (1.20x the budget" in line
    assert line in str(report)
    estimate.step_peak = 95 * 2**20  # within the budget: nothing to say
    assert report.budget_check_line() is None
    estimate.step_peak, estimate.scheduled = 120 * 2**20, False  # FX order (cache hit): the plan's own prediction
    assert report.budget_check_line() is None


@pytest.mark.parametrize("plan", ["kv_ring", "burst"])
def test_a_padded_batch_counts_its_batch_groups_copies(plan):
    """Key padding over more than one batch row may run as batch groups (decided at run time): the estimate adds
    one gathered copy of the op's inputs and, in fp32, each loop's results copied into the whole outputs."""
    from burstc.attention_ir import Documents, KeyPadding, MaskSpec
    from burstc.memory import ring_backward_buffers, ring_forward_buffers

    # against packed documents: also runtime data (the masked kernel's estimate alike), but no batch groups
    documents = (MaskSpec.causal() & Documents("position_ids")).encode()
    padded = (MaskSpec.causal() & KeyPadding("attention_mask")).encode()
    for batch in (1, 3):
        q, k, v, grad_out = (torch.empty(batch, 4, 64, 16) for _ in range(4))
        tensor_bytes = q.numel() * 4
        forward_extra = ring_forward_buffers(q, k, v, "zigzag", padded, 2) - \
            ring_forward_buffers(q, k, v, "zigzag", documents, 2)
        backward_extra = ring_backward_buffers(grad_out, q, k, v, "zigzag", padded, plan, 2) - \
            ring_backward_buffers(grad_out, q, k, v, "zigzag", documents, plan, 2)
        if batch == 1:
            assert forward_extra == backward_extra == 0
        else:
            rows = batch * 4 * 64 * 4  # lse or delta, fp32 [B, H, S]
            assert forward_extra == 3 * tensor_bytes + tensor_bytes  # q, k, v gathered; the fp32 accumulator
            # grad_out, q, k, v, out, lse, delta gathered; each loop's fp32 dq, dk, dv
            assert backward_extra == 5 * tensor_bytes + 2 * rows + 3 * tensor_bytes


@pytest.mark.parametrize("budget_mib, seq_len", [(64, 1024), (32, 4096)], ids=["one_chunk", "sixteen_chunks"])
def test_masked_block_kernel_memory_matches_its_estimate(monkeypatch, budget_mib, seq_len):
    """The element-wise masked kernel's measured peak (one block, forward and backward, after a warm-up call)
    against ``masked_kernel_bytes``, one chunk and sixteen of 32 MiB each: within 15% (the measurement is the
    process's resident peak: a few MiB of mask booleans and allocator slack ride on it).  Eight heads, so that the
    [B, rows, keys] booleans are 1/32 of a chunk."""
    import burstc.kernels.masked_attention_blocks as masked
    from burstc.attention_ir import KeyPadding, MaskSpec
    from burstc.memory import masked_kernel_bytes

    monkeypatch.setattr(masked, "MASKED_SCORE_BUDGET_BYTES", budget_mib * MIB)
    exact_cpu_peaks()
    B, H, S, D = 1, 8, seq_len, 32
    spec = MaskSpec.causal() & KeyPadding("attention_mask")
    valid = torch.ones(B, S, dtype=torch.bool)
    valid[0, S - S // 3:] = False
    q, k, v, grad_out = (torch.randn(B, H, S, D) for _ in range(4))
    positions = torch.arange(S)
    for _ in range(2):  # the first call's allocations (BLAS buffers) are not the kernel's
        with measure_peak("cpu") as forward:
            out, lse = masked.masked_block_forward(q, k, v, positions, positions, spec, 0.2, key_valid_BS=valid)
        with measure_peak("cpu") as backward:
            grads = masked.masked_block_backward(grad_out, q, k, v, lse, None, out, positions, positions, spec, 0.2,
                                                 key_valid_BS=valid)
    assert all(bool(torch.isfinite(g).all()) for g in grads)
    for op, peak in (("forward", forward), ("backward", backward)):
        predicted = masked_kernel_bytes(op, spec, S, S, B, H, H, D, 4)
        assert 0.9 <= peak.extra_bytes / predicted <= 1.15, (op, peak.extra_bytes / MIB, predicted / MIB)


def test_prefetched_buffers_are_held_from_where_the_prefetch_goes_to_the_ring_backward():
    """Two ring backwards with a matmul before each: the prefetch of each goes after the last placeholder / the
    previous ring backward, so its receive buffers are live at the nodes between (and not at the rings, whose own
    buffers count them); the hybrid ring is not prefetched; with the pass off nothing is held ahead."""
    import burstc.ops.ring_attention  # noqa: F401  (registers the ops)
    from burstc.memory import _Storages, prefetch_ahead, prefetch_buffers, replay

    ring_backward = torch.ops.burstc.ring_attention_backward.default
    batch, heads, local_len, head_dim = 1, 2, 64, 16

    def backward_graph(group_names):
        graph = torch.fx.Graph()
        values = {}
        for name, shape, dtype in (("grad_out", (batch, heads, local_len, head_dim), torch.float32),
                                   ("q", (batch, heads, local_len, head_dim), torch.float32),
                                   ("k", (batch, heads, local_len, head_dim), torch.float32),
                                   ("v", (batch, heads, local_len, head_dim), torch.float32),
                                   ("out", (batch, heads, local_len, head_dim), torch.float32),
                                   ("lse", (batch, heads, local_len), torch.float32),
                                   ("w", (head_dim, head_dim), torch.float32)):
            values[name] = graph.placeholder(name)
            values[name].meta["val"] = torch.empty(shape, dtype=dtype, device="meta")
        nodes = values
        outs = []
        for layer in range(2):
            mm = graph.call_function(torch.ops.aten.mm.default, (nodes["w"], nodes["w"]))
            mm.meta["val"] = torch.empty(head_dim, head_dim, device="meta")
            # grad_out made right before the ring (as the output projection's backward makes it): the prefetch
            # does not read it, so it still goes before the matmul
            grad = graph.call_function(torch.ops.aten.mul.Tensor, (nodes["grad_out"], 2.0))
            grad.meta["val"] = torch.empty(batch, heads, local_len, head_dim, device="meta")
            ring = graph.call_function(ring_backward, (
                grad, nodes["q"], nodes["k"], nodes["v"], nodes["out"], nodes["lse"], None,
                group_names, "zigzag", "causal", 0.25, "kv_ring"))
            ring.meta["val"] = tuple(torch.empty(batch, heads, local_len, head_dim, device="meta") for _ in range(3))
            first = graph.call_function(operator.getitem, (ring, 0))
            first.meta["val"] = ring.meta["val"][0]
            outs += [mm, first]
        graph.output(tuple(outs))
        return torch.fx.GraphModule(torch.nn.Module(), graph)

    gm = backward_graph(["0"])
    q = gm.graph.find_nodes(op="placeholder", target="q")[0].meta["val"]
    nbytes = prefetch_buffers(q, q, q, "zigzag", "causal", "kv_ring", 2)
    assert nbytes == 2 * q.nbytes  # one visiting shard of K and V
    order = list(gm.graph.nodes)
    held = prefetch_ahead(2)(order)
    names_held = {n.name: b for n, b in zip(order, held) if b}
    assert names_held == {"mm_default": nbytes, "mul_tensor": nbytes, "getitem": nbytes, "mm_default_1": nbytes,
                          "mul_tensor_1": nbytes}, names_held
    # the replay: the peak stays at the second ring (the first matmul, the first ring's returned gradient, the
    # second matmul, its grad_out and its three gradients: 1 + 8 + 1 + 8 + 24 KiB), where nothing is held ahead;
    # between the rings the held buffers count: at the getitem after the first ring (its three gradients and the
    # first matmul, 25 KiB) four times them would be the peak
    plain, _ = replay(gm, _Storages(), "b")
    with_ahead, _ = replay(gm, _Storages(), "b", ahead_buffers=prefetch_ahead(2))
    assert (plain.peak_node, plain.peak_bytes) == ("ring_attention_backward_default_1", 42 * 1024)
    assert (with_ahead.peak_node, with_ahead.peak_bytes) == ("ring_attention_backward_default_1", 42 * 1024)
    held_more, _ = replay(gm, _Storages(), "b", ahead_buffers=lambda order: [4 * b for b in prefetch_ahead(2)(order)])
    assert (held_more.peak_node, held_more.peak_bytes) == ("getitem", 25 * 1024 + 4 * nbytes)
    assert not any(prefetch_ahead(2)(list(backward_graph(["ulysses", "0", "1"]).graph.nodes)))
