"""Ring attention (burstc.ops.ring_attention) against single-device SDPA, on gloo worker groups.

Multi-rank tasks run in one persistent WorkerGroup per world size for the whole module (hypothesis
examples included).  Every task receives a seed and builds the full inputs from it on every rank,
so all ranks agree; each rank compares its own rows (``burstc.layout.shard``) of the single-device
reference and returns error numbers, which the parent asserts on.
"""
from __future__ import annotations

import dataclasses
import math

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from burstc import layout as layouts
from burstc.kernels import attention_blocks as kb
from burstc.ops import lse_merge
from burstc.ops import ring_attention as ra
from burstc.testing import WorkerError, tolerance

aten = torch.ops.aten

# Max |ring - reference| allowed: atol + rtol * max|reference|, from burstc.testing.oracle.TOLERANCES
# ("attention_<name>" per dtype).  The reference is single-device SDPA in fp32 on the same (already
# rounded) inputs.
COMPARED = ("out", "lse", "dq", "dk", "dv")


@dataclasses.dataclass(frozen=True)
class Case:
    world_size: int
    batch: int
    heads_q: int
    heads_kv: int
    local_len: int
    head_dim: int
    causal: bool
    layout: str
    plan: str
    dtype: torch.dtype
    seed: int
    scale: float | None = None
    lse_grad: bool = False  # also differentiate through the returned lse
    out_grad: bool = True   # differentiate through the output (False: lse only)


def _full_inputs(case: Case):
    generator = torch.Generator().manual_seed(case.seed)
    seq_len = case.local_len * case.world_size
    shape_q = (case.batch, case.heads_q, seq_len, case.head_dim)
    shape_kv = (case.batch, case.heads_kv, seq_len, case.head_dim)
    q, grad_out = (torch.randn(shape_q, generator=generator).to(case.dtype) for _ in range(2))
    k, v = (torch.randn(shape_kv, generator=generator).to(case.dtype) for _ in range(2))
    grad_lse = torch.randn(shape_q[:3], generator=generator)
    return q, k, v, grad_out, grad_lse


def _reference(case: Case, q, k, v, grad_out, grad_lse):
    """fp32 single-device SDPA (out, grads) and the fp32 natural-log LSE of the scaled scores."""
    q32, k32, v32 = (t.to(torch.float32).clone().requires_grad_() for t in (q, k, v))
    scale = case.scale if case.scale is not None else case.head_dim ** -0.5
    out = F.scaled_dot_product_attention(q32, k32, v32, is_causal=case.causal, scale=scale, enable_gqa=True)
    groups = case.heads_q // case.heads_kv
    scores = (q32 @ k32.repeat_interleave(groups, 1).transpose(-1, -2)) * scale
    if case.causal:
        seq_len = q.shape[2]
        scores = scores.masked_fill(~torch.ones(seq_len, seq_len, dtype=torch.bool).tril(), float("-inf"))
    lse = torch.logsumexp(scores, -1)
    loss = ((out * grad_out.float()).sum() if case.out_grad else 0.0) + ((lse * grad_lse).sum() if case.lse_grad else 0.0)
    loss.backward()
    grads = [t.grad if t.grad is not None else torch.zeros_like(t) for t in (q32, k32, v32)]  # lse ignores v
    return {"out": out.detach(), "lse": lse.detach(), "dq": grads[0], "dk": grads[1], "dv": grads[2]}


def _errors(mine: dict, reference: dict) -> dict:
    errors = {}
    for name in mine:
        got, want = mine[name].to(torch.float32), reference[name]
        assert got.shape == want.shape, (name, got.shape, want.shape)
        diff = (got - want).abs().max().item() if got.numel() else 0.0
        errors[name] = {"max_error": diff if math.isfinite(diff) else float("inf"),
                        "scale": want.abs().max().item() if want.numel() else 0.0,
                        "finite": bool(torch.isfinite(got).all())}
    return errors


def _run_case(rank, world_size, case: Case, group_or_mesh_kind: str = "default"):
    """Worker task: ring attention fwd+bwd on this rank's shard vs the fp32 single-device reference."""
    assert world_size == case.world_size
    q, k, v, grad_out, grad_lse = _full_inputs(case)
    reference = _reference(case, q, k, v, grad_out, grad_lse)
    shard = lambda t: layouts.shard(t, 2, world_size, rank, case.layout)  # noqa: E731
    q_l, k_l, v_l = (shard(t).requires_grad_() for t in (q, k, v))
    group_or_mesh = None
    if group_or_mesh_kind == "mesh":
        from torch.distributed.device_mesh import init_device_mesh

        group_or_mesh = init_device_mesh("cpu", (world_size,))
    elif group_or_mesh_kind == "group":
        group_or_mesh = dist.group.WORLD
    with ra.record_stats() as stats:
        out, lse = ra.ring_attention_with_lse(q_l, k_l, v_l, group_or_mesh=group_or_mesh, causal=case.causal,
                                              layout=case.layout, plan=case.plan, scale=case.scale)
        loss = (out.float() * shard(grad_out).float()).sum() if case.out_grad else 0.0
        if case.lse_grad:
            loss = loss + (lse * shard(grad_lse)).sum()
        loss.backward()
    mine = {"out": out, "lse": lse, "dq": q_l.grad, "dk": k_l.grad, "dv": v_l.grad}
    result = _errors(mine, {name: shard(t) for name, t in reference.items()})
    result["dtypes"] = {"out": out.dtype, "lse": lse.dtype, "dq": q_l.grad.dtype}
    result["plans"] = [c.plan for c in stats.of("backward")]
    return result


def _assert_close(case: Case, per_rank_results: list[dict]) -> None:
    for rank, result in enumerate(per_rank_results):
        assert result["dtypes"] == {"out": case.dtype, "lse": torch.float32, "dq": case.dtype}
        for name in COMPARED:
            error = result[name]
            assert error["finite"], f"rank {rank}: {name} has non-finite values ({case})"
            allowed = tolerance(case.dtype, f"attention_{name}")
            bound = allowed.atol + allowed.rtol * error["scale"]
            assert error["max_error"] <= bound, (
                f"rank {rank}: {name} max error {error['max_error']:.3g} > {bound:.3g} ({case})")


# the conftest's `workers` fixture gives this module's worker groups this run timeout
WORKER_RUN_TIMEOUT_S = 300


# ---------------------------------------------------------------------------------------------
# Multi-rank correctness


@st.composite
def cases(draw, world_sizes=(1, 2, 3, 4), dtypes=(torch.float32, torch.bfloat16)):
    layout = draw(st.sampled_from(layouts.LAYOUTS))
    heads_kv = draw(st.sampled_from([1, 2]))
    local_len = draw(st.integers(1, 12)) * 2 if layout == "zigzag" else draw(st.integers(1, 24))
    return Case(
        world_size=draw(st.sampled_from(world_sizes)),
        batch=draw(st.sampled_from([1, 2])),
        heads_q=heads_kv * draw(st.sampled_from([1, 2, 3])),  # MHA, GQA, and MQA when heads_kv == 1
        heads_kv=heads_kv,
        local_len=local_len,
        head_dim=draw(st.sampled_from([8, 16, 20])),
        causal=draw(st.booleans()),
        layout=layout,
        plan=draw(st.sampled_from(ra.PLAN_CHOICES)),
        dtype=draw(st.sampled_from(dtypes)),
        seed=draw(st.integers(0, 2**31 - 1)),
        scale=draw(st.sampled_from([None, 0.3])),
    )


@pytest.mark.multirank
@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(case=cases())
def test_matches_single_device_sdpa(workers, case):
    _assert_close(case, workers.get(case.world_size).run(_run_case, case))


@pytest.mark.multirank
@pytest.mark.parametrize("plan", ra.PLANS)
@pytest.mark.parametrize("layout", layouts.LAYOUTS)
@pytest.mark.parametrize("world_size", [2, 4])
def test_every_plan_and_layout_causal_gqa(workers, world_size, layout, plan):
    case = Case(world_size, 2, 4, 2, 8, 16, True, layout, plan, torch.float32, seed=world_size * 7)
    _assert_close(case, workers.get(world_size).run(_run_case, case))


@pytest.mark.multirank
@pytest.mark.parametrize("plan", ra.PLANS)
def test_fp16(workers, plan):
    case = Case(3, 1, 4, 4, 6, 16, True, "zigzag", plan, torch.float16, seed=11)
    _assert_close(case, workers.get(3).run(_run_case, case))


@pytest.mark.multirank
@pytest.mark.parametrize("plan", ra.PLANS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gradient_through_lse(workers, plan, dtype):
    case = Case(3, 1, 4, 2, 6, 8, True, "striped", plan, dtype, seed=5, lse_grad=True)
    _assert_close(case, workers.get(3).run(_run_case, case))


@pytest.mark.multirank
@pytest.mark.parametrize("plan", ra.PLANS)
def test_gradient_through_lse_only(workers, plan):
    """grad_out is 0 everywhere, so no stand-in output can carry delta = -grad_lse: the block
    backward must switch to the kernel that takes delta."""
    case = Case(2, 1, 2, 1, 8, 8, True, "zigzag", plan, torch.float32, seed=8, lse_grad=True, out_grad=False)
    _assert_close(case, workers.get(2).run(_run_case, case))


@pytest.mark.multirank
@pytest.mark.parametrize("kind", ["mesh", "group"])
def test_group_or_mesh_argument(workers, kind):
    case = Case(2, 1, 2, 2, 8, 8, True, "zigzag", "burst", torch.float32, seed=3)
    _assert_close(case, workers.get(2).run(_run_case, case, kind))


@pytest.mark.multirank
def test_auto_plan_picks_burst_for_mha_and_kv_ring_for_gqa(workers):
    mha = Case(2, 1, 4, 4, 8, 16, True, "zigzag", "auto", torch.float32, seed=1)
    gqa = dataclasses.replace(mha, heads_kv=1)
    assert {p for r in workers.get(2).run(_run_case, mha) for p in r["plans"]} == {"burst"}
    assert {p for r in workers.get(2).run(_run_case, gqa) for p in r["plans"]} == {"kv_ring"}


def _run_on_submesh(rank, world_size, case: Case):
    """2 x 2 mesh; the ring runs over the 'dp' dimension, whose groups are {0, 2} and {1, 3}, so
    group ranks differ from global ranks."""
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "cp"))
    ring_mesh = mesh["dp"]
    ring_rank = ring_mesh.get_local_rank()
    q, k, v, grad_out, grad_lse = _full_inputs(case)
    reference = _reference(case, q, k, v, grad_out, grad_lse)
    shard = lambda t: layouts.shard(t, 2, 2, ring_rank, case.layout)  # noqa: E731
    q_l, k_l, v_l = (shard(t).requires_grad_() for t in (q, k, v))
    out, lse = ra.ring_attention_with_lse(q_l, k_l, v_l, group_or_mesh=ring_mesh, causal=True, layout=case.layout,
                                          plan=case.plan)
    out.backward(shard(grad_out))
    mine = {"out": out, "lse": lse, "dq": q_l.grad, "dk": k_l.grad, "dv": v_l.grad}
    result = _errors(mine, {name: shard(t) for name, t in reference.items()})
    result["dtypes"] = {"out": out.dtype, "lse": lse.dtype, "dq": q_l.grad.dtype}
    return result


@pytest.mark.multirank
@pytest.mark.parametrize("plan", ra.PLANS)
def test_ring_over_submesh_dimension(workers, plan):
    case = Case(2, 1, 2, 1, 6, 8, True, "striped", plan, torch.float32, seed=9)
    _assert_close(case, workers.get(4).run(_run_on_submesh, case))


def _run_case_with_reference_kernels(rank, world_size, case: Case):
    with kb.reference_block_kernels():
        return _run_case(rank, world_size, case)


@pytest.mark.multirank
@pytest.mark.parametrize("plan", ra.PLANS)
def test_reference_block_kernels_in_the_ring(workers, plan):
    """The plain-torch block kernels (the non-CPU path) give the same ring results."""
    for layout in layouts.LAYOUTS:
        case = Case(3, 1, 4, 2, 6, 8, True, layout, plan, torch.float32, seed=21)
        _assert_close(case, workers.get(3).run(_run_case_with_reference_kernels, case))


# ---------------------------------------------------------------------------------------------
# Work balance and the counters


def _work_and_bytes(rank, world_size, case: Case):
    q, k, v, grad_out, _ = _full_inputs(case)
    shard = lambda t: layouts.shard(t, 2, world_size, rank, case.layout)  # noqa: E731
    q_l, k_l, v_l = (shard(t).requires_grad_() for t in (q, k, v))
    with ra.record_stats() as stats:
        out = ra.ring_attention(q_l, k_l, v_l, causal=case.causal, layout=case.layout, plan=case.plan)
        out.backward(shard(grad_out))
    return [dataclasses.asdict(c) for c in stats.calls]


def _per_step_work(per_rank_calls, op):
    """work[rank][step] of the single call ``op``."""
    return [[c for c in calls if c["op"] == op][0]["work_per_step"] for calls in per_rank_calls]


@pytest.mark.multirank
@pytest.mark.parametrize("plan", ra.PLANS)
@pytest.mark.parametrize("world_size", [2, 3, 4])
def test_zigzag_work_is_exactly_balanced(workers, world_size, plan):
    case = Case(world_size, 1, 2, 2, 8, 8, True, "zigzag", plan, torch.float32, seed=0)
    calls = workers.get(world_size).run(_work_and_bytes, case)
    s = case.local_len
    for op in ("forward", "backward"):
        work = _per_step_work(calls, op)
        for step in range(world_size):
            column = [work[rank][step] for rank in range(world_size)]
            assert max(column) / (sum(column) / world_size) == 1.0, (op, step, column)
            expected = s * (s + 1) // 2 if step == 0 else s * s // 2  # diagonal block, then s^2/2
            assert column[0] == case.batch * case.heads_q * expected
        assert len({sum(w) for w in work}) == 1


@pytest.mark.multirank
@pytest.mark.parametrize("world_size", [2, 4])
def test_striped_work_balanced_within_one_row(workers, world_size):
    case = Case(world_size, 1, 2, 2, 8, 8, True, "striped", "kv_ring", torch.float32, seed=0)
    work = _per_step_work(workers.get(world_size).run(_work_and_bytes, case), "forward")
    one_row = case.batch * case.heads_q * case.local_len
    for step in range(world_size):
        column = [work[rank][step] for rank in range(world_size)]
        assert max(column) - min(column) <= one_row, (step, column)
    totals = [sum(w) for w in work]
    assert max(totals) - min(totals) <= (world_size - 1) * one_row


@pytest.mark.multirank
def test_contiguous_causal_work_is_unbalanced(workers):
    """The counter sees the imbalance the balanced layouts remove (and can fail the tests above)."""
    case = Case(4, 1, 2, 2, 8, 8, True, "contiguous", "kv_ring", torch.float32, seed=0)
    work = _per_step_work(workers.get(4).run(_work_and_bytes, case), "forward")
    totals = [sum(w) for w in work]
    assert totals == sorted(totals) and totals[-1] > 3 * totals[0]
    assert [work[0][step] for step in range(1, 4)] == [0, 0, 0]  # rank 0 skips every remote block


@pytest.mark.multirank
def test_forward_bytes_per_step_are_exactly_kv(workers):
    """Full attention: every rank's K/V goes to every other rank.  Causal zigzag: a later rank needs only
    the head chunk (half the rows), an earlier one both chunks (by hand, P = 3)."""
    case = Case(3, 2, 4, 2, 6, 8, False, "zigzag", "burst", torch.bfloat16, seed=0)
    kv_bytes = 2 * case.batch * case.heads_kv * case.local_len * case.head_dim * 2  # k and v, bf16
    for calls in workers.get(3).run(_work_and_bytes, case):
        forward = [c for c in calls if c["op"] == "forward"][0]
        assert forward["bytes_sent_per_step"] == forward["bytes_received_per_step"] == [kv_bytes, kv_bytes, 0]
    causal = dataclasses.replace(case, causal=True)
    half = kv_bytes // 2
    # rank r sends at step t to rank r + t + 1 and receives from rank r - t - 1
    sent = {0: [half, half, 0], 1: [half, kv_bytes, 0], 2: [kv_bytes, kv_bytes, 0]}
    received = {0: [kv_bytes, kv_bytes, 0], 1: [half, kv_bytes, 0], 2: [half, half, 0]}
    for rank, calls in enumerate(workers.get(3).run(_work_and_bytes, causal)):
        forward = [c for c in calls if c["op"] == "forward"][0]
        assert forward["bytes_sent_per_step"] == sent[rank], rank
        assert forward["bytes_received_per_step"] == received[rank], rank


# ---------------------------------------------------------------------------------------------
# torch.compile


def _compiled_matches_eager(rank, world_size, case: Case, backend: str):
    import torch._dynamo

    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (world_size,))
    q, k, v, grad_out, _ = _full_inputs(case)
    shard = lambda t: layouts.shard(t, 2, world_size, rank, case.layout)  # noqa: E731

    def attention(q_, k_, v_):
        out, lse = ra.ring_attention_with_lse(torch.sin(q_), k_ * 2, v_, group_or_mesh=mesh, causal=case.causal,
                                              layout=case.layout, plan=case.plan)
        return out.float().square().sum() + lse.sum()

    results = {}
    for mode in ("eager", "compiled"):
        torch._dynamo.reset()
        fn = attention if mode == "eager" else torch.compile(attention, backend=backend, fullgraph=True)
        q_l, k_l, v_l = (shard(t).requires_grad_() for t in (q, k, v))
        with ra.record_stats() as stats:
            loss = fn(q_l, k_l, v_l)
            loss.backward()
        results[mode] = (loss.detach(), q_l.grad, k_l.grad, v_l.grad, [c.op for c in stats.calls])
    eager, compiled = results["eager"], results["compiled"]
    return {"ops": compiled[4],
            # relative to the magnitude: inductor fuses sin/square/sum in a different order
            "max_diff": max(((a.float() - b.float()).abs().max() / (1 + a.float().abs().max())).item()
                            for a, b in zip(eager[:4], compiled[:4]))}


@pytest.mark.multirank
@pytest.mark.parametrize("backend,plan,layout", [
    ("aot_eager", "burst", "zigzag"),
    ("aot_eager", "kv_ring", "striped"),
    ("inductor", "auto", "zigzag"),
    ("inductor", "kv_ring", "contiguous"),
])
def test_torch_compile_fullgraph(workers, backend, plan, layout):
    case = Case(2, 1, 4, 2, 8, 16, True, layout, plan, torch.float32, seed=2)
    for result in workers.get(2).run(_compiled_matches_eager, case, backend):
        assert result["ops"] == ["forward", "backward"]  # the custom ops ran inside the compiled graph
        assert result["max_diff"] <= 1e-5


# ---------------------------------------------------------------------------------------------
# Local pieces: merge, kernels (no process group needed; block selection: test_ring_pieces.py)


@pytest.mark.parametrize("causal", [True, False])
def test_merge_of_key_blocks_equals_full_attention(causal):
    generator = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 3, 10, 8, generator=generator, dtype=torch.float64) for _ in range(3))
    scale = 0.35
    out_full, lse_full = kb.reference_block_forward(q, k, v, causal, scale)
    # keys in three blocks; block 1 and 2 only matter where the causal mask lets rows see them
    bounds = [(0, 3), (3, 7), (7, 10)]
    out_acc, lse_acc = None, None
    for start, stop in bounds:
        scores = (q @ k[:, :, start:stop].transpose(-1, -2)) * scale
        if causal:
            keep = torch.arange(start, stop)[None, :] <= torch.arange(10)[:, None]
            scores = scores.masked_fill(~keep, float("-inf"))
        lse = torch.logsumexp(scores, -1)  # -inf on rows that see nothing of this block
        out = torch.nan_to_num(torch.softmax(scores, -1)) @ v[:, :, start:stop]
        if out_acc is None:
            out_acc, lse_acc = out.clone(), lse.clone()
        else:
            lse_merge.merge_attention_block_(out_acc, lse_acc, out, lse)
    assert torch.isfinite(out_acc).all() and torch.isfinite(lse_acc).all()
    torch.testing.assert_close(out_acc, out_full, atol=1e-12, rtol=1e-12)
    torch.testing.assert_close(lse_acc, lse_full, atol=1e-12, rtol=1e-12)


def test_merge_is_stable_for_large_lse_gaps():
    out_acc = torch.ones(1, 1, 2, 4)
    lse_acc = torch.tensor([[[1000.0, -1000.0]]])
    lse_merge.merge_attention_block_(out_acc, lse_acc, torch.full((1, 1, 2, 4), 3.0), torch.tensor([[[-1000.0, 1000.0]]]))
    torch.testing.assert_close(out_acc, torch.tensor([1.0, 3.0]).view(1, 1, 2, 1).expand(1, 1, 2, 4))
    torch.testing.assert_close(lse_acc, torch.tensor([[[1000.0, 1000.0]]]))


def _local_inputs(dtype, heads_q=4, heads_kv=2, q_len=10, kv_len=10, seed=0):
    generator = torch.Generator().manual_seed(seed)
    q = torch.randn(2, heads_q, q_len, 8, generator=generator).to(dtype)
    k, v = (torch.randn(2, heads_kv, kv_len, 8, generator=generator).to(dtype) for _ in range(2))
    grad_out = torch.randn(2, heads_q, q_len, 8, generator=generator).to(dtype)
    return q, k, v, grad_out


def test_cpu_flash_lse_layout_and_convention():
    q, k, v, _ = _local_inputs(torch.float32)
    out, lse = aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, True, scale=0.3)
    assert lse.stride() == (10 * 4, 1, 4)  # [B, H, S] view of a [B, S, H] buffer
    converted = lse_merge.lse_to_BHS(lse)
    assert converted.is_contiguous() and converted.dtype == torch.float32
    scores = (q @ k.repeat_interleave(2, 1).transpose(-1, -2)) * 0.3
    scores = scores.masked_fill(~torch.ones(10, 10, dtype=torch.bool).tril(), float("-inf"))
    torch.testing.assert_close(converted, torch.logsumexp(scores, -1))  # natural log, scaled scores


def test_cpu_flash_backward_uses_out_only_through_rowsum():
    """What makes the stand-in output valid: moving ``out`` orthogonally to ``grad_out`` (so that
    rowsum(out * grad_out) is unchanged) leaves every gradient unchanged (fp64: exact to 1e-13)."""
    q, k, v, grad_out = _local_inputs(torch.float64)
    out, lse = aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, True)
    noise = torch.randn_like(out)
    noise -= (noise * grad_out).sum(-1, keepdim=True) / (grad_out * grad_out).sum(-1, keepdim=True) * grad_out
    grads = aten._scaled_dot_product_flash_attention_for_cpu_backward(grad_out, q, k, v, out, lse, 0.0, True)
    moved = aten._scaled_dot_product_flash_attention_for_cpu_backward(grad_out, q, k, v, out + 5 * noise, lse, 0.0, True)
    for a, b in zip(grads, moved):
        torch.testing.assert_close(a, b, atol=1e-13, rtol=0)
    # and the kernel does read out: changing rowsum(out * grad_out) changes dq
    shifted = aten._scaled_dot_product_flash_attention_for_cpu_backward(grad_out, q, k, v, out + grad_out, lse, 0.0, True)
    assert (shifted[0] - grads[0]).abs().max() > 1e-3


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_stand_in_output_reproduces_delta_and_gradients(dtype):
    q, k, v, grad_out = _local_inputs(dtype)
    grad_out[:, :, 3] = 0  # a zero row: the stand-in is 0 there
    out, lse = aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, True)
    delta = lse_merge.attention_delta(out, grad_out)
    stand_in = lse_merge.stand_in_output(grad_out, delta)
    assert stand_in.dtype == dtype and torch.all(stand_in[:, :, 3] == 0)
    rebuilt = lse_merge.attention_delta(stand_in, grad_out)
    allowed = tolerance(dtype, "attention_stand_in_delta")  # fp32: exact up to rounding; bf16: stand-in rounded
    torch.testing.assert_close(rebuilt, delta, atol=allowed.atol, rtol=allowed.rtol)
    assert lse_merge.stand_in_output(grad_out, delta - 1.0) is None  # zero row, delta != 0: impossible
    real = aten._scaled_dot_product_flash_attention_for_cpu_backward(grad_out, q, k, v, out, lse, 0.0, True)
    fake = kb.block_attention_backward(grad_out, q, k, v, lse_merge.lse_to_BHS(lse), delta, None, True, 1 / math.sqrt(8))
    allowed = tolerance(dtype, "attention_block_grads")
    for a, b in zip(real, fake):
        torch.testing.assert_close(a.float(), b.float(), atol=allowed.atol, rtol=allowed.rtol)


@pytest.mark.parametrize("causal,q_len,kv_len", [(True, 10, 10), (False, 6, 10), (True, 5, 10), (True, 9, 4)])
@pytest.mark.parametrize("heads_kv", [1, 2, 4])
def test_reference_kernels_match_cpu_flash(causal, q_len, kv_len, heads_kv):
    q, k, v, grad_out = _local_inputs(torch.float32, heads_kv=heads_kv, q_len=q_len, kv_len=kv_len)
    out_flash, lse_flash = kb.block_attention_forward(q, k, v, causal, 0.4)
    with kb.reference_block_kernels():
        out_ref, lse_ref = kb.block_attention_forward(q, k, v, causal, 0.4)
        grads_ref = kb.block_attention_backward(grad_out, q, k, v, lse_ref, None, out_ref, causal, 0.4)
    torch.testing.assert_close(out_ref, out_flash, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(lse_ref, lse_flash, atol=1e-5, rtol=1e-5)
    grads_flash = kb.block_attention_backward(grad_out, q, k, v, lse_flash, None, out_flash, causal, 0.4)
    for a, b in zip(grads_ref, grads_flash):
        assert a.shape == b.shape
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)


def test_reference_kernels_chunk_rows_within_the_score_budget(monkeypatch):
    assert kb._reference_row_chunk(1, 32, 32768) == 64  # one [1, 32, 64, 32K] fp32 buffer = 256 MiB
    assert kb._reference_row_chunk(8, 64, 2**20) == kb._REFERENCE_MIN_ROWS
    # a budget of a few rows: many chunks (uneven last one) still give the unchunked result
    q, k, v, grad_out = _local_inputs(torch.float32, heads_kv=2, q_len=50, kv_len=50)
    out_flash, lse_flash = kb.block_attention_forward(q, k, v, True, 0.4)
    grads_flash = kb.block_attention_backward(grad_out, q, k, v, lse_flash, None, out_flash, True, 0.4)
    monkeypatch.setattr(kb, "_REFERENCE_SCORE_BUDGET_BYTES", 16 * q.shape[1] * 50 * 4)
    assert kb._reference_row_chunk(q.shape[0], q.shape[1], 50) == 16
    with kb.reference_block_kernels():
        out_ref, lse_ref = kb.block_attention_forward(q, k, v, True, 0.4)
        grads_ref = kb.block_attention_backward(grad_out, q, k, v, lse_ref, None, out_ref, True, 0.4)
    torch.testing.assert_close(out_ref, out_flash, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(lse_ref, lse_flash, atol=1e-5, rtol=1e-5)
    for a, b in zip(grads_ref, grads_flash):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)


# ---------------------------------------------------------------------------------------------
# Clear errors


def _qkv(heads_q=4, heads_kv=2, local_len=4, dtype=torch.float32):
    return torch.randn(1, heads_q, local_len, 8, dtype=dtype), *(torch.randn(1, heads_kv, local_len, 8, dtype=dtype) for _ in range(2))


def test_error_when_process_group_not_initialized():
    assert not dist.is_initialized()
    with pytest.raises(RuntimeError, match="initialized torch.distributed"):
        ra.ring_attention(*_qkv())


@pytest.mark.parametrize("make_inputs,kwargs,error,match", [
    (lambda: _qkv(heads_q=3, heads_kv=2), {}, ValueError, "multiple of the number of kv heads"),
    (lambda: _qkv(local_len=5), {"layout": "zigzag"}, ValueError, "S_local must be even"),
    (lambda: _qkv(), {"layout": "diagonal"}, ValueError, "layout must be one of"),
    (lambda: _qkv(), {"plan": "fastest"}, ValueError, "plan must be one of"),
    (lambda: (torch.randn(1, 4, 4, 8), torch.randn(1, 2, 6, 8), torch.randn(1, 2, 6, 8)), {}, ValueError, "must agree"),
    (lambda: (torch.randn(1, 4, 4, 8), torch.randn(1, 2, 4, 8), torch.randn(1, 1, 4, 8)), {}, ValueError, "same shape"),
    (lambda: (torch.randn(4, 4, 8),) * 3, {}, ValueError, r"\[B, H, S_local, D\]"),
    (lambda: _qkv(dtype=torch.float64), {}, TypeError, "dtype"),
])
def test_bad_inputs_raise_clear_errors(make_inputs, kwargs, error, match):
    with pytest.raises(error, match=match):
        ra.ring_attention(*make_inputs(), **kwargs)


def _mesh_of_dims(rank, world_size, shape, ring):
    from torch.distributed.device_mesh import init_device_mesh

    ra.ring_attention(*_qkv(), group_or_mesh=init_device_mesh("cpu", shape), ring=ring)


@pytest.mark.multirank
def test_meshes_the_ring_cannot_run_on_are_rejected(workers):
    """A 3-D mesh; a double ring on a mesh of one node (the double ring's tests: tests/test_double_ring.py)."""
    with pytest.raises(WorkerError, match="1-D or 2-D DeviceMesh"):
        workers.get(2).run(_mesh_of_dims, (1, 1, 2), "auto")
    with pytest.raises(WorkerError, match="at least 2 x 2"):
        workers.get(2).run(_mesh_of_dims, (1, 2), "double")


def _run_under_autocast(rank, world_size, case: Case):
    """q, k in fp32 (as RoPE leaves them) and v in bf16, inside torch.autocast: the ring casts all three
    to bf16 as SDPA does; its gradients come back in each input's own dtype."""
    q, k, v, grad_out, _ = _full_inputs(case)
    v = v.to(torch.bfloat16)
    shard = lambda t: layouts.shard(t, 2, world_size, rank, case.layout)  # noqa: E731
    q_l, k_l, v_l = (shard(t).requires_grad_() for t in (q, k, v))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = ra.ring_attention(q_l, k_l, v_l, causal=case.causal, layout=case.layout, plan=case.plan)
    (out.float() * shard(grad_out).float()).sum().backward()
    reference = _reference(case, *(t.to(torch.bfloat16) for t in (q, k, v)), grad_out.to(torch.bfloat16), None)
    mine = {"out": out, "dq": q_l.grad, "dk": k_l.grad, "dv": v_l.grad}
    result = _errors(mine, {name: shard(reference[name]) for name in mine})
    result["dtypes"] = {name: t.dtype for name, t in mine.items()}
    return result


@pytest.mark.multirank
@pytest.mark.parametrize("plan", ra.PLANS)
def test_autocast_casts_like_sdpa(workers, plan):
    case = Case(world_size=2, batch=1, heads_q=4, heads_kv=2, local_len=8, head_dim=16, causal=True,
                layout="zigzag", plan=plan, dtype=torch.float32, seed=11)
    for result in workers.get(2).run(_run_under_autocast, case):
        assert result.pop("dtypes") == {"out": torch.bfloat16, "dq": torch.float32, "dk": torch.float32,
                                        "dv": torch.bfloat16}
        for name, error in result.items():
            allowed = tolerance(torch.bfloat16, f"attention_{name}")
            assert error["finite"] and error["max_error"] <= allowed.atol + allowed.rtol * error["scale"], \
                (name, error)


def _shard_seq_and_its_gradient(rank, world_size, layout, seq_len, padded_len):
    """Worker task: burstc::shard_seq's rows and the gradient its backward scatters back, against the layout."""
    import burstc.ops.sequence  # noqa: F401 - registers burstc::shard_seq

    gen = torch.Generator().manual_seed(0)
    x = torch.randn(2, seq_len, 3, generator=gen).requires_grad_()
    local = torch.ops.burstc.shard_seq(x, 1, dist.group.WORLD.group_name, layout, padded_len)
    grad_local = torch.randn(local.shape, generator=gen) + rank
    local.backward(grad_local)
    positions = layouts.local_positions(max(seq_len, padded_len), world_size, rank, layout)
    padded_x = torch.cat([x.detach(), x.new_zeros(2, max(padded_len - seq_len, 0), 3)], 1)
    want_grad = torch.zeros_like(padded_x).index_copy(1, positions, grad_local)[:, :seq_len]
    return torch.equal(local, padded_x[:, positions]), torch.equal(x.grad, want_grad)


@pytest.mark.parametrize("layout", layouts.LAYOUTS)
@pytest.mark.parametrize("seq_len,padded_len", [(12, -1), (14, 16)])
def test_shard_seq_gradient_goes_back_to_the_layout_positions(workers, layout, seq_len, padded_len):
    for rows_right, grad_right in workers.get(2).run(_shard_seq_and_its_gradient, layout, seq_len, padded_len):
        assert rows_right and grad_right
