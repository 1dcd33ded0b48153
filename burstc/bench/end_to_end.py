"""``burstc bench``: one full training step (forward, backward, AdamW) of a tiny HF Llama, burstc vs its peers.

    burstc bench                                   # P=2 gloo ranks, S = 1K, 2K, 4K, every row, the cap search
    burstc bench --seq-lens 2048 8192 --rows burstc torch_ring eager --memory-cap-mib 0   # no cap search
    burstc bench --emulated-network                # how to run the same under the emulated cluster
    burstc bench --ranks 4 --mesh 2x2 ...          # burstc's rows on a 2 nodes x 2 ranks mesh (its double ring)
    python -m burstc.bench.end_to_end ...          # the same (python benchmarks/end_to_end.py in a checkout)

It needs ``transformers`` (the model) and, for the lucidrains row, ``ring-attention-pytorch``:
``pip install 'burstc[bench]'``; a row whose peer is missing is reported as skipped.

Rows (the same model, weights, tokens and AdamW; ``ROWS``):

* ``burstc``, ``burstc_selective``: ``burstc.compile(model, mesh)`` with its defaults (Inductor, fused LM head +
  loss, zigzag), and with ``checkpoint="selective"``; every rank is given the whole batch, burstc shards it.
* ``burstc_layers``, ``burstc_torch_budget`` (not run unless ``--rows`` names them: the checkpointing comparison of
  issue 18): ``checkpoint="layers"``, and burstc's defaults under torch's own
  ``torch._functorch.config.activation_memory_budget`` (``--budget``) on the same sharded model.
* ``torch_ring``: PyTorch's own ring (``_templated_ring_attention`` / ``_backward`` driven by the CPU flash ops,
  head-tail load balance, K/V rotated around the ring) as the model's attention function (HF's attention registry);
  input ids, positions and labels sharded by hand in the head-tail (zigzag) layout; unfused loss (logits, then
  cross-entropy); parameter gradients summed over the ranks with one all-reduce.
* ``allgather_kv``: Llama-3-style context parallelism: K/V all-gathered, each local chunk attends to its causal
  prefix, dK/dV reduce-scattered by autograd; otherwise as ``torch_ring``.
* ``lucidrains_zigzag``: ``ring_attention_pytorch.zig_zag_attention.zig_zag_attn`` as shipped (all-gather K/V and
  SDPA with a dense zigzag mask over all keys); query heads permuted so that its tiled GQA grouping is Llama's
  ``repeat_kv`` grouping.  Its all-gather backward keeps only the local part of dK/dV, so its gradients are wrong
  (the ``grad err`` column shows it); speed and memory are those of the algorithm as shipped.
* ``eager``, ``compile``, ``compile_budget``: one process, no parallelism (the whole sequence): eager, default
  ``torch.compile``, and ``torch.compile`` under ``torch._functorch.config.activation_memory_budget`` (``--budget``).

Columns: tokens/s per rank (tokens a rank trains per second, best of ``--steps`` timed steps after a warm-up step
that compiles, slowest rank); tokens per CPU-second per rank (the same tokens over the CPU time the rank's process,
its communication threads included, spent in the step: on a machine shared with other work a wall-clock step
mostly measures the scheduler, the more so for P rank processes than for one; best step, slowest rank); peak memory per rank (:func:`burstc.memory.measure_peak` over the timed steps, i.e. the
step's peak above what the process held before it, plus the parameters and AdamW state); attention bytes sent per
rank per step (burstc: its ring's byte counters; peers: their algorithm's bytes by formula,
:func:`burstc.bench.peers.peer_bytes`; the parameter-gradient all-reduce, the same for every distributed
row, is not counted); MFU (model FLOPs per rank per second over the measured peak of one CPU thread, see
:func:`step_flops` and :func:`measure_cpu_peak_flops`); loss and gradient-norm error of step 0 against ``eager`` at
the same length; ratios to the best peer (the fastest non-burstc row at that length; by CPU time, the peer with
the most tokens per CPU-second).  Every rank and the
one-process rows run one thread, so a rank is one core.  Then, per row, the longest sequence whose measured peak
stays within ``--memory-cap-mib``: each attempt in a fresh process group, doubling then bisecting on a grid.
"""
from __future__ import annotations

import argparse
import contextlib
import dataclasses
import functools
import gc
import importlib.util
import json
import math
import os
import shlex
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F

from burstc import layout as layouts
from burstc.bench.peers import TorchRing, allgather_kv_attention, peer_bytes
from burstc.testing import WorkerGroup, zoo

ROWS = ("burstc", "burstc_selective", "burstc_selective_half", "burstc_layers", "burstc_torch_budget",
        "burstc_sac_matmuls", "torch_ring", "allgather_kv", "lucidrains_zigzag", "eager", "compile", "compile_budget")
BURSTC_ROWS = ("burstc", "burstc_selective", "burstc_selective_half", "burstc_layers", "burstc_torch_budget",
               "burstc_sac_matmuls")
# the checkpointing comparison (issue 18): burstc's modes, and torch's own answers on the same sharded model (its
# activation_memory_budget; a user's selective activation checkpointing that saves every matmul); not run by default
# (``--rows`` names them)
CHECKPOINT_ROWS = ("burstc_selective_half", "burstc_layers", "burstc_torch_budget", "burstc_sac_matmuls")
# rows run once per ``--budgets`` value, keyed "row@budget" in the results
BUDGET_ROWS = ("burstc_torch_budget", "compile_budget")
DEFAULT_ROWS = tuple(row for row in ROWS if row not in CHECKPOINT_ROWS)
SHARDED_PEERS = ("torch_ring", "allgather_kv", "lucidrains_zigzag")
ONE_PROCESS = ("eager", "compile", "compile_budget")
LABELS = {
    "burstc": "burstc (defaults)", "burstc_selective": "burstc checkpoint=selective",
    "burstc_selective_half": "burstc checkpoint=selective, checkpoint_keep=0.5",
    "burstc_layers": "burstc checkpoint=layers",
    "burstc_torch_budget": "burstc + torch activation_memory_budget",
    "burstc_sac_matmuls": "burstc + user SAC saving matmuls",
    "torch_ring": "torch ring (head-tail)", "allgather_kv": "all-gather K/V (Llama-3)",
    "lucidrains_zigzag": "lucidrains zig-zag", "eager": "eager, 1 process", "compile": "torch.compile, 1 process",
    "compile_budget": "torch.compile + memory budget, 1 process",
}


def row_key(row: str, budget: float) -> str:
    """The results' key of ``row`` run at ``budget``: ``row@budget`` for the budget rows, else ``row``."""
    return f"{row}@{budget:g}" if row in BUDGET_ROWS else row


def base_row(key: str) -> str:
    return key.split("@", 1)[0]


def label(key: str) -> str:
    """``LABELS`` of the key's row, with the budget of a budget row."""
    row, _, budget = key.partition("@")
    return f"{LABELS[row]} {budget}" if budget else LABELS[row]


EMULATED_CLUSTER = Path("/work/shared/tools/emulated-cluster/emulated-cluster")


@dataclasses.dataclass(frozen=True)
class ModelShape:
    dim: int = 128
    layers: int = 2
    heads: int = 4
    kv_heads: int = 2
    ffn: int = 512
    vocab: int = 4096

    @property
    def head_dim(self) -> int:
        return self.dim // self.heads


@dataclasses.dataclass(frozen=True)
class Case:
    """One row at one length on ``ranks`` ranks (1 for the one-process rows)."""

    row: str
    seq_len: int
    ranks: int
    shape: ModelShape
    steps: int = 2
    budget: float = 0.5
    burstc_backend: str = "inductor"
    seed: int = 0
    mesh: tuple[int, int] | None = None  # burstc's rows: (nodes, ranks per node) instead of a 1-D mesh

    @property
    def key(self) -> str:
        return row_key(self.row, self.budget)


def step_flops(shape: ModelShape, seq_len: int) -> float:
    """Model FLOPs of one training step over the whole sequence, counted as BurstEngine counts them (Megatron's
    formula: backward = 2x forward, so 3x the forward; causal attention = half the full S x S score matrix):
    every matmul (q/k/v/o projections, gated MLP, LM head) at 2 FLOPs per multiply-add, plus QK^T and PV at
    4 H D per visible (query, key) pair with S^2 / 2 pairs.  Embedding, norms, RoPE and softmax are not counted."""
    h, hd = shape.dim, shape.head_dim
    per_token_layer = 2 * h * shape.heads * hd + 2 * 2 * h * shape.kv_heads * hd + 2 * shape.heads * hd * h \
        + 3 * 2 * h * shape.ffn
    forward = seq_len * (shape.layers * per_token_layer + 2 * h * shape.vocab)
    forward += shape.layers * 4 * shape.heads * hd * seq_len * seq_len / 2
    return 3.0 * forward


def measure_cpu_peak_flops(size: int = 1024, repeats: int = 10) -> float:
    """FLOP/s of the best of ``repeats`` fp32 ``size``^3 matmuls on one thread: the peak a rank (one thread) can
    reach here, the denominator of MFU."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        a, b = torch.randn(size, size), torch.randn(size, size)
        torch.mm(a, b)
        best = math.inf
        for _ in range(repeats):
            start = time.perf_counter()
            torch.mm(a, b)
            best = min(best, time.perf_counter() - start)
    finally:
        torch.set_num_threads(threads)
    return 2.0 * size ** 3 / best


# ---------------------------------------------------------------------------------------------------------------
# the model, its batch and the peers' attention functions


def build_model(shape: ModelShape, seq_len: int, seed: int, attn_implementation: str = "sdpa"):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    config = LlamaConfig(vocab_size=shape.vocab, hidden_size=shape.dim, intermediate_size=shape.ffn,
                         num_hidden_layers=shape.layers, num_attention_heads=shape.heads,
                         num_key_value_heads=shape.kv_heads, max_position_embeddings=seq_len,
                         attn_implementation=attn_implementation)
    return LlamaForCausalLM(config)


def batch_ids(shape: ModelShape, seq_len: int, seed: int) -> torch.Tensor:
    return torch.randint(0, shape.vocab, (1, seq_len), generator=torch.Generator().manual_seed(seed + 1))


def hf_loss(model, ids):
    return model(input_ids=ids, labels=ids, use_cache=False).loss


class _PeerAttention:
    """An HF attention function (``fn(module, query, key, value, attention_mask, scaling=..., **kw)`` with
    query ``[B, H, s, D]``, K/V ``[B, Hkv, s, D]``, returning ``([B, s, H, D], None)``) for one sharded peer at one
    length; the attention mask HF passes (none: the name has no mask function) is ignored, causality comes from the
    zigzag positions."""

    def __init__(self, row: str, seq_len: int, world_size: int, rank: int, group):
        self.row, self.group = row, group
        self.positions = layouts.local_positions(seq_len, world_size, rank, "zigzag")
        if row == "lucidrains_zigzag":
            self.mask = self.positions[:, None] >= layouts.permutation(seq_len, world_size, "zigzag")[None, :]

    def __call__(self, module, query, key, value, attention_mask=None, scaling=None, dropout=0.0, **kwargs):
        if scaling is not None and abs(scaling - query.shape[-1] ** -0.5) > 1e-12:
            raise ValueError(f"{self.row}: only the default softmax scale is wired, got {scaling}")
        if self.row == "torch_ring":
            from torch.distributed.tensor.experimental._context_parallel._attention import _RotateMethod

            out = TorchRing.apply(query, key, value, self.group, _RotateMethod.ALL_TO_ALL)
        elif self.row == "allgather_kv":
            out = allgather_kv_attention(query, key, value, self.group)
        else:
            out = self._lucidrains(query, key, value)
        return out.transpose(1, 2).contiguous(), None

    def _lucidrains(self, query, key, value):
        from ring_attention_pytorch.zig_zag_attention import zig_zag_attn

        heads, kv_heads = query.shape[1], key.shape[1]
        group_size = heads // kv_heads
        # zig_zag_attn tiles K/V over query heads (query head j reads kv head j % Hkv); Llama's repeat_kv reads
        # kv head i // group: hand it the query heads in the order that makes the two agree, and undo it after
        order = torch.arange(heads).view(kv_heads, group_size).t().reshape(-1)
        out = zig_zag_attn(query[:, order], key, value, attn_mask=self.mask)
        return out[:, torch.argsort(order)]


def _sum_gradients(model, group) -> None:
    """Sum every parameter gradient over the ranks (one flat all-reduce, as a DDP bucket would)."""
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    flat = torch.cat([g.reshape(-1) for g in grads])
    dist.all_reduce(flat, group=group)
    offset = 0
    for g in grads:
        g.copy_(flat[offset:offset + g.numel()].view_as(g))
        offset += g.numel()


def _grad_norm(model) -> float:
    return math.sqrt(sum(float(p.grad.double().pow(2).sum()) for p in model.parameters() if p.grad is not None))


def _state_bytes(model, optimizer) -> int:
    """Parameters and AdamW state (resident between steps)."""
    total = sum(p.numel() * p.element_size() for p in model.parameters())
    for state in optimizer.state.values():
        total += sum(t.numel() * t.element_size() for t in state.values() if torch.is_tensor(t) and t.dim() > 0)
    return total


def _make_step(case: Case, rank: int, world_size: int):
    """(model, loss_fn, tokens per rank, context factory or None): ``loss_fn()`` runs forward and backward (and the
    gradient all-reduce for the hand-sharded peers) and returns the global loss as a tensor; the context (a
    compiler config) is entered around every step."""
    ids = batch_ids(case.shape, case.seq_len, case.seed)
    context = None
    if case.row in BURSTC_ROWS:
        import burstc
        from torch.distributed.device_mesh import init_device_mesh

        model = build_model(case.shape, case.seq_len, case.seed)
        if case.mesh is not None:  # named so that burstc sees a topology: its planner picks the ring per attention
            mesh = init_device_mesh("cpu", case.mesh, mesh_dim_names=("inter", "intra"))
        else:
            mesh = init_device_mesh("cpu", (world_size,)) if world_size > 1 else None
        options = {} if case.burstc_backend == "inductor" else {"backend": case.burstc_backend}  # inductor: the default
        if case.row in ("burstc_selective", "burstc_selective_half", "burstc_layers"):
            options["checkpoint"] = case.row.removeprefix("burstc_").removesuffix("_half")
        if case.row == "burstc_selective_half":
            options["checkpoint_keep"] = 0.5
        if case.row == "burstc_torch_budget":  # torch's min-cut partitioner under a budget, burstc's defaults else
            context = functools.partial(torch._functorch.config.patch, activation_memory_budget=case.budget)
        if case.row == "burstc_sac_matmuls":  # what a user would write: HF's checkpointing with a SAC policy
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={
                "use_reentrant": False, "context_fn": zoo.save_matmuls_context})
        with context() if context is not None else contextlib.nullcontext():
            compiled = burstc.compile(model, mesh, **options)

        def loss_fn():
            loss = hf_loss(compiled, ids)
            loss.backward()
            return loss.detach()
        return model, loss_fn, case.seq_len // world_size, context
    if case.row in SHARDED_PEERS:
        from transformers import AttentionInterface

        group = dist.group.WORLD
        name = f"burstc_bench_{case.row}"  # no mask function under this name: HF builds no mask
        attention = _PeerAttention(case.row, case.seq_len, world_size, rank, group)
        AttentionInterface.register(name, attention)
        model = build_model(case.shape, case.seq_len, case.seed, attn_implementation=name)
        positions = attention.positions
        labels = torch.cat([ids[:, 1:], torch.full((1, 1), -100)], dim=1)  # HF's shift, done before sharding
        local_ids, local_labels = ids[:, positions], labels[:, positions]
        targets = case.seq_len - 1

        def loss_fn():
            logits = model(input_ids=local_ids, position_ids=positions[None], use_cache=False).logits
            loss = F.cross_entropy(logits.float().flatten(0, 1), local_labels.flatten(), ignore_index=-100,
                                   reduction="sum") / targets
            loss.backward()
            _sum_gradients(model, group)
            total = loss.detach().clone()
            dist.all_reduce(total, group=group)
            return total
        return model, loss_fn, case.seq_len // world_size, context
    if case.row not in ONE_PROCESS:
        raise ValueError(f"unknown row {case.row!r}; rows: {', '.join(ROWS)}")
    model = build_model(case.shape, case.seq_len, case.seed)
    runner = model
    if case.row != "eager":
        torch._dynamo.reset()
        runner = torch.compile(model)
    if case.row == "compile_budget":
        context = functools.partial(torch._functorch.config.patch, activation_memory_budget=case.budget)

    def loss_fn():
        loss = hf_loss(runner, ids)
        loss.backward()
        return loss.detach()
    return model, loss_fn, case.seq_len, context


# Rows prepared in this worker (one process holds several rows at one length, so that their timed steps can be
# interleaved: load from other work on a shared machine then hits every row alike).
_PREPARED: dict[str, dict] = {}


def prepare_case(rank: int, world_size: int, case: Case) -> dict:
    """Worker task: build ``case``'s row, run its warm-up step (compiles; gives the step-0 loss and gradient norm)
    and keep it here for :func:`step_case`."""
    model, loss_fn, tokens, context = _make_step(case, rank, world_size)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    started = time.perf_counter()
    with context() if context is not None else contextlib.nullcontext():
        loss0 = loss_fn()
        grad_norm0 = _grad_norm(model)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    _PREPARED[case.key] = {"model": model, "optimizer": optimizer, "loss_fn": loss_fn, "context": context,
                           "distributed": world_size > 1}
    return {"warmup_s": time.perf_counter() - started, "tokens": tokens, "loss0": float(loss0),
            "grad_norm0": grad_norm0}


def step_case(rank: int, world_size: int, key: str) -> dict:
    """Worker task: one timed training step of a prepared row (ranks start it together); its time, its peak
    (above what the process held before it, plus the parameters and AdamW state) and burstc's ring bytes."""
    from burstc.memory import measure_peak
    from burstc.ops.ring_attention import record_stats

    state = _PREPARED[key]
    context = state["context"]
    with context() if context is not None else contextlib.nullcontext():
        with record_stats() as stats, measure_peak("cpu") as peak:
            if state["distributed"]:
                dist.barrier()
            started, cpu_started = time.perf_counter(), time.process_time()
            state["loss_fn"]()
            state["optimizer"].step()
            state["optimizer"].zero_grad(set_to_none=True)
            elapsed, cpu = time.perf_counter() - started, time.process_time() - cpu_started
    return {"time_s": elapsed, "cpu_s": cpu, "activation_bytes": peak.extra_bytes,
            "peak_bytes": peak.extra_bytes + _state_bytes(state["model"], state["optimizer"]),
            "burstc_bytes_sent": sum(c.total_bytes_sent for c in stats.calls),
            "burstc_bytes_by_link": stats.bytes_sent_by_link,
            "load_average": os.getloadavg()[0]}


def release_cases(rank: int, world_size: int) -> None:
    """Worker task: drop every prepared row and its compiled graphs."""
    _PREPARED.clear()
    torch._dynamo.reset()
    gc.collect()


def run_case(rank: int, world_size: int, case: Case) -> tuple[dict, list[dict]]:
    """Worker task: :func:`prepare_case`, ``case.steps`` timed steps, release (one row alone, for the cap search)."""
    try:
        prepared = prepare_case(rank, world_size, case)
        return prepared, [step_case(rank, world_size, case.key) for _ in range(case.steps)]
    finally:
        release_cases(rank, world_size)


# ---------------------------------------------------------------------------------------------------------------
# the driver


def attention_bytes(case: Case) -> tuple[int, str]:
    """(attention bytes each sharded peer's rank sends per training step, how they were counted)."""
    if case.row in ONE_PROCESS:
        return 0, "one process"
    forward, backward = peer_bytes(case.row, world_size=case.ranks, seq_len=case.seq_len, batch=1,
                                   heads_q=case.shape.heads, heads_kv=case.shape.kv_heads,
                                   head_dim=case.shape.head_dim, element_size=4)
    return case.shape.layers * (forward + backward), "formula (burstc.bench.peers.peer_bytes) x layers"


def combine(case: Case, prepared: list[dict], steps: list[list[dict]], peak_flops: float) -> dict:
    """One row at one length from every rank's numbers (``prepared[rank]``, ``steps[step][rank]``): the slowest rank
    per step, the best step; the highest peak."""
    times = [max(r["time_s"] for r in ranks) for ranks in steps]
    step_s = min(times)
    cpu_s = min(max(r["cpu_s"] for r in ranks) for ranks in steps)
    tokens = prepared[0]["tokens"]
    by_link = {}
    if case.row in BURSTC_ROWS:
        sent, how = max(r["burstc_bytes_sent"] for r in steps[-1]), "measured (record_stats)"
        links = {link for r in steps[-1] for link in r["burstc_bytes_by_link"]}
        by_link = {link: max(r["burstc_bytes_by_link"].get(link, 0) for r in steps[-1]) / 2**20 for link in links}
    else:
        sent, how = attention_bytes(case)
    return {
        "ranks": case.ranks, "step_s": step_s, "step_median_s": sorted(times)[len(times) // 2],
        "warmup_s": max(r["warmup_s"] for r in prepared),
        "tokens_per_s_per_rank": tokens / step_s,
        "cpu_s": cpu_s, "tokens_per_cpu_s_per_rank": tokens / cpu_s,
        "peak_mib_per_rank": max(r["peak_bytes"] for ranks in steps for r in ranks) / 2**20,
        "activation_mib_per_rank": max(r["activation_bytes"] for ranks in steps for r in ranks) / 2**20,
        "attention_mib_sent_per_rank": sent / 2**20, "bytes_counted": how,
        "attention_mib_sent_by_link": by_link,  # the busiest rank's, per link class (burstc's rows)
        "mfu": step_flops(case.shape, case.seq_len) / case.ranks / step_s / peak_flops,
        "loss0": prepared[0]["loss0"], "grad_norm0": prepared[0]["grad_norm0"],
        "load_average": max(r["load_average"] for ranks in steps for r in ranks),
    }


def _row_ranks(key: str, ranks: int) -> int:
    return 1 if base_row(key) in ONE_PROCESS else ranks


def expand_rows(rows: list[str], budgets: list[float]) -> list[str]:
    """The results' keys: each budget row once per budget."""
    return [row_key(row, b) for row in rows for b in (budgets if row in BUDGET_ROWS else [0.0])]


def case_of(key: str, seq_len: int, args, shape: ModelShape, steps: int) -> Case:
    row, _, budget = key.partition("@")
    return Case(row, seq_len, _row_ranks(key, args.ranks), shape, steps, float(budget) if budget else 0.5,
                args.burstc_backend, args.seed, args.mesh if row in BURSTC_ROWS else None)


def _unavailable(key: str) -> str | None:
    if base_row(key) == "lucidrains_zigzag":
        try:
            import ring_attention_pytorch  # noqa: F401
        except ImportError as exc:
            return f"ring-attention-pytorch is not installed ({exc}); pip install ring-attention-pytorch"
    return None


class _Progress:
    """tqdm (a burstc dependency) when wanted, else one plain line per item."""

    def __init__(self, total: int, enabled: bool):
        self.bar = None
        if enabled:
            from tqdm import tqdm

            self.bar = tqdm(total=total, desc="burstc bench", file=sys.stderr, dynamic_ncols=True)

    def update(self, text: str, grow: int = 0) -> None:
        if self.bar is None:
            print(f"burstc bench: {text}", file=sys.stderr, flush=True)
            return
        if grow:
            self.bar.total += grow
        self.bar.set_postfix_str(text)
        self.bar.update(1)

    def close(self):
        if self.bar is not None:
            self.bar.close()


def _grid(ranks: int) -> int:
    """Lengths tried by the cap search are multiples of this (the zigzag layout needs 2P)."""
    return max(256, 2 * ranks * 64)


def _fits(case: Case, cap_mib: float, timeout_s: float, peak_flops: float) -> tuple[bool, dict]:
    """One attempt at ``case`` in a fresh process group: (measured peak <= cap, numbers or the error)."""
    try:
        with WorkerGroup(case.ranks, run_timeout_s=timeout_s) as workers:
            per_rank = workers.run(run_case, case)
            row = combine(case, [p for p, _ in per_rank], [list(r) for r in zip(*(t for _, t in per_rank))],
                          peak_flops)
    except Exception as exc:  # a rank that ran out of memory or time: did not fit
        return False, {"error": f"{type(exc).__name__}: {str(exc).splitlines()[0][:200]}"}
    return row["peak_mib_per_rank"] <= cap_mib, row


def longest_under_cap(base: Case, measured: dict[int, dict], cap_mib: float, *, max_seq_len: int, bisect: int,
                      timeout_s: float, peak_flops: float, progress: _Progress) -> dict:
    """The longest length on the grid whose measured peak per rank is within ``cap_mib``: from the sweep's
    lengths, doubling past the longest that fits, then ``bisect`` halvings of the gap; every new length is one
    attempt in a fresh process group (1 warm-up + 1 measured step)."""
    grid = _grid(base.ranks)
    peaks = {s: m["peak_mib_per_rank"] for s, m in measured.items()}
    attempts = []

    def attempt(seq_len):
        fits, row = _fits(dataclasses.replace(base, seq_len=seq_len, steps=1), cap_mib, timeout_s, peak_flops)
        peaks[seq_len] = row.get("peak_mib_per_rank", math.inf)
        attempts.append({"seq_len": seq_len, "fits": fits, **row})
        progress.update(f"cap {base.row} S={seq_len}: {'fits' if fits else 'over'}", grow=1)
        return fits

    fitting = [s for s, p in peaks.items() if p <= cap_mib]
    lo = max(fitting) if fitting else None
    if lo is None:  # even the shortest sweep length is over: halve down the grid
        s = min(peaks) // 2 // grid * grid
        while s >= grid and lo is None:
            lo = s if attempt(s) else None
            s = s // 2 // grid * grid
        if lo is None:
            return {"seq_len": 0, "peak_mib_per_rank": None, "attempts": attempts, "note": "nothing fits"}
    over = [s for s, p in peaks.items() if p > cap_mib and s > lo]
    hi = min(over) if over else None
    while hi is None:
        s = 2 * lo
        if s > max_seq_len:
            break
        if attempt(s):
            lo = s
        else:
            hi = s
    for _ in range(bisect if hi is not None else 0):
        mid = (lo + hi) // 2 // grid * grid
        if mid <= lo:
            break
        if attempt(mid):
            lo = mid
        else:
            hi = mid
    note = f"reached --max-seq-len {max_seq_len}" if hi is None else f"next length tried ({hi}) is over the cap"
    return {"seq_len": lo, "peak_mib_per_rank": peaks[lo], "attempts": attempts, "note": note}


def ratios(results: dict) -> None:
    """Add tokens/s and memory ratios to the best peer (the fastest non-burstc row at each length)."""
    lengths = sorted({s for row in results.values() for s in row.get("by_seq_len", {})})
    for s in lengths:
        cells = {name: row["by_seq_len"][s] for name, row in results.items() if s in row.get("by_seq_len", {})}
        peers = {name: c for name, c in cells.items() if base_row(name) not in BURSTC_ROWS}
        if not peers:
            continue
        best_name = max(peers, key=lambda n: peers[n]["tokens_per_s_per_rank"])
        best = peers[best_name]
        for cell in cells.values():
            cell["best_peer"] = best_name
            cell["tokens_vs_best_peer"] = cell["tokens_per_s_per_rank"] / best["tokens_per_s_per_rank"]
            if "tokens_per_cpu_s_per_rank" in cell and all("tokens_per_cpu_s_per_rank" in c for c in peers.values()):
                best_cpu = max(c["tokens_per_cpu_s_per_rank"] for c in peers.values())  # (older JSON: none)
                cell["cpu_tokens_vs_best_peer"] = cell["tokens_per_cpu_s_per_rank"] / best_cpu
            cell["memory_vs_best_peer"] = cell["peak_mib_per_rank"] / best["peak_mib_per_rank"]


def errors_vs_eager(results: dict) -> None:
    eager = results.get("eager", {}).get("by_seq_len", {})
    for row in results.values():
        for s, cell in row.get("by_seq_len", {}).items():
            if s in eager:
                ref = eager[s]
                cell["loss_error_vs_eager"] = abs(cell["loss0"] - ref["loss0"]) / abs(ref["loss0"])
                cell["grad_norm_error_vs_eager"] = abs(cell["grad_norm0"] - ref["grad_norm0"]) / ref["grad_norm0"]


def targets(results: dict) -> dict:
    """The issue's targets for each burstc row, at the longest sweep length every row trains (within the memory cap
    when the cap search ran): tokens/s >= 1.2x and peak <= 0.75x the best peer's (the fastest non-burstc row; also
    given against the fastest sharded peer); the longest length under the cap >= 2x the best peer's."""
    ran = {name: row for name, row in results.items() if row.get("by_seq_len")}
    common = set.intersection(*(set(row["by_seq_len"]) for row in ran.values())) if ran else set()
    longest = {n: r["longest_under_cap"]["seq_len"] for n, r in ran.items() if "longest_under_cap" in r}
    if longest:
        common = {s for s in common if s <= min(longest.values())}
    out = {}
    if not common:
        return out
    s = max(common)
    out["common_seq_len"] = s
    out["within_cap"] = bool(longest)
    for name in [n for n in ran if base_row(n) in BURSTC_ROWS]:
        cell = ran[name]["by_seq_len"][s]
        entry = {"best_peer": cell["best_peer"], "tokens_ratio": cell["tokens_vs_best_peer"],
                 "memory_ratio": cell["memory_vs_best_peer"],
                 "tokens_met": cell["tokens_vs_best_peer"] >= 1.2, "memory_met": cell["memory_vs_best_peer"] <= 0.75}
        sharded = {n: ran[n]["by_seq_len"][s] for n in SHARDED_PEERS if n in ran}
        if sharded:
            best = max(sharded, key=lambda n: sharded[n]["tokens_per_s_per_rank"])
            entry.update(best_sharded_peer=best,
                         sharded_tokens_ratio=cell["tokens_per_s_per_rank"] / sharded[best]["tokens_per_s_per_rank"],
                         sharded_memory_ratio=cell["peak_mib_per_rank"] / sharded[best]["peak_mib_per_rank"])
        peer_longest = {n: v for n, v in longest.items() if base_row(n) not in BURSTC_ROWS}
        if name in longest and peer_longest:
            best = max(peer_longest, key=peer_longest.get)
            entry.update(longest=longest[name], best_peer_longest=(best, peer_longest[best]),
                         longest_ratio=longest[name] / max(1, peer_longest[best]),
                         longest_met=longest[name] >= 2 * peer_longest[best])
        out[name] = entry
    return out


def checkpoint_targets(results: dict) -> dict:
    """Issue 18's targets from the burstc rows that ran, at the longest sweep length they all train: selective's
    step time and activation memory (the step's growth) against ``checkpoint="none"`` (the defaults), each mode's
    longest length under the cap against none's and its tokens/s there against none's at none's longest, and
    selective against torch's own answers on the same sharded model (``activation_memory_budget`` at each budget
    that ran, a user's SAC policy): per answer, and against the fastest answer whose peak is within selective's
    (the "equal memory" comparison; none when no answer gets that low)."""
    ran = {name: row for name, row in results.items()
           if base_row(name) in BURSTC_ROWS and row.get("by_seq_len")}
    if "burstc" not in ran or len(ran) < 2:
        return {}
    common = set.intersection(*(set(row["by_seq_len"]) for row in ran.values()))
    if not common:
        return {}
    s = max(common)
    none = ran["burstc"]["by_seq_len"][s]
    out = {"seq_len": s}
    for name, row in ran.items():
        cell = row["by_seq_len"][s]
        entry = {"step_vs_none": cell["step_s"] / none["step_s"],
                 "activation_vs_none": cell.get("activation_mib_per_rank", float("nan"))
                 / max(none.get("activation_mib_per_rank", float("nan")), 1e-9),
                 "peak_mib": cell["peak_mib_per_rank"], "tokens_per_s": cell["tokens_per_s_per_rank"]}
        if "longest_under_cap" in row and "longest_under_cap" in ran["burstc"]:
            entry["longest"] = row["longest_under_cap"]["seq_len"]
            entry["longest_vs_none"] = entry["longest"] / max(1, ran["burstc"]["longest_under_cap"]["seq_len"])
        out[name] = entry
    if "burstc_selective" not in out:
        return out
    selective = out["burstc_selective"]
    selective["step_met"] = selective["step_vs_none"] <= 1.10
    selective["activation_met"] = selective["activation_vs_none"] <= 0.60
    torch_answers = {n: out[n] for n in out if base_row(n) in ("burstc_torch_budget", "burstc_sac_matmuls")}
    if torch_answers:
        versus = {n: {"tokens_ratio": selective["tokens_per_s"] / a["tokens_per_s"],
                      "peak_ratio": selective["peak_mib"] / a["peak_mib"]} for n, a in torch_answers.items()}
        within = [n for n, a in torch_answers.items() if a["peak_mib"] <= selective["peak_mib"]]
        fastest = max(within, key=lambda n: torch_answers[n]["tokens_per_s"]) if within else None
        out["selective_vs_torch"] = {
            "each": versus, "equal_memory_answer": fastest,
            "equal_memory_tokens_ratio": versus[fastest]["tokens_ratio"] if fastest else None,
            # met when selective is >= 1.1x the fastest answer that fits in its memory, or none fits
            "equal_memory_met": versus[fastest]["tokens_ratio"] >= 1.10 if fastest else True}
    return out


def markdown(report: dict) -> str:
    cfg, machine, results = report["config"], report["machine"], report["results"]
    shape = cfg["shape"]
    lines = [
        f"# burstc bench: one training step (forward, backward, AdamW) of a tiny HF Llama",
        "",
        f"Model: dim {shape['dim']}, {shape['layers']} layers, {shape['heads']} heads ({shape['kv_heads']} kv), "
        f"ffn {shape['ffn']}, vocab {shape['vocab']}, fp32, batch 1. Sharded rows on {cfg['ranks']} gloo ranks "
        f"(zigzag"
        + (f"; burstc's on a {cfg['mesh'][0]} x {cfg['mesh'][1]} mesh, the peers' on the flat group" if cfg.get("mesh")
           else "")
        + f"), one thread per rank; one-process rows on one thread. Best of {cfg['steps']} timed steps after a "
        f"warm-up step (slowest rank). Machine: {machine['cpus']} CPUs, load average {machine['load_start']:.1f} at "
        f"the start, {machine['load_end']:.1f} at the end (shared with other work); torch {machine['torch']}. "
        f"MFU against {machine['peak_gflops']:.1f} GFLOP/s per thread ({machine['peak_method']}). "
        f"Command: `{cfg['command']}`.",
        "",
        "| system | ranks | S | tokens/s/rank | step s | tokens/CPU-s/rank | peak MiB/rank | attention MiB sent/rank "
        "| MFU | loss err vs eager | grad-norm err vs eager | tokens/s vs best peer | tokens/CPU-s vs best peer "
        "| memory vs best peer |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for name, row in results.items():
        if "skipped" in row:
            lines.append(f"| {label(name)} | - | - | n/a: {row['skipped']} | | | | | | | | | | |")
            continue
        for s, c in sorted(row["by_seq_len"].items()):
            sent = f"{c['attention_mib_sent_per_rank']:.1f}" + (" (formula)" if c["bytes_counted"].startswith(
                "formula") else "")
            links = c.get("attention_mib_sent_by_link") or {}
            if set(links) - {"ring"}:  # a 2-D mesh: the busiest rank's bytes per link class
                sent += " (" + ", ".join(f"{link} {mib:.1f}" for link, mib in sorted(links.items())) + ")"
            err = lambda key: f"{c[key]:.1e}" if key in c else "-"  # noqa: E731
            per_cpu_s = f"{c['tokens_per_cpu_s_per_rank']:,.0f}" if "tokens_per_cpu_s_per_rank" in c else "-"
            cpu_ratio = f"{c['cpu_tokens_vs_best_peer']:.2f}x" if "cpu_tokens_vs_best_peer" in c else "-"
            lines.append(
                f"| {label(name)} | {c['ranks']} | {s} | {c['tokens_per_s_per_rank']:,.0f} | {c['step_s']:.3f} "
                f"| {per_cpu_s} | {c['peak_mib_per_rank']:.0f} | {sent} | {100 * c['mfu']:.1f}% "
                f"| {err('loss_error_vs_eager')} | {err('grad_norm_error_vs_eager')} "
                f"| {c.get('tokens_vs_best_peer', 0):.2f}x | {cpu_ratio} | {c.get('memory_vs_best_peer', 0):.2f}x |")
    if cfg["memory_cap_mib"]:
        lines += ["", f"Longest sequence trained within {cfg['memory_cap_mib']:.0f} MiB per rank (measured peak; grid "
                      f"of {_grid(cfg['ranks'])}, doubling then {cfg['cap_bisect']} bisection(s), up to "
                      f"{cfg['max_seq_len']}; each attempt in fresh processes):", "",
                  "| system | longest S | its peak MiB/rank | lengths tried (fits / over) | note |", "|---|---|---|---|---|"]
        for name, row in results.items():
            cap = row.get("longest_under_cap")
            if cap is None:
                continue
            tried = ", ".join(f"{a['seq_len']} {'ok' if a['fits'] else 'over'}" for a in cap["attempts"]) or "sweep only"
            peak = f"{cap['peak_mib_per_rank']:.0f}" if cap["peak_mib_per_rank"] is not None else "-"
            lines.append(f"| {label(name)} | {cap['seq_len']} | {peak} | {tried} | {cap['note']} |")
    goal = report["targets"]
    if goal:
        where = "within the memory cap" if goal["within_cap"] else "in the sweep"
        lines += ["", f"Targets at S = {goal['common_seq_len']} (the longest sweep length every row trains {where}):"]
        for name in [n for n in goal if base_row(n) in BURSTC_ROWS]:
            t = goal[name]
            text = (f"- {label(name)}: tokens/s {t['tokens_ratio']:.2f}x the best peer ({label(t['best_peer'])}; "
                    f"target >= 1.2x: {'met' if t['tokens_met'] else 'not met'}), peak memory {t['memory_ratio']:.2f}x "
                    f"(target <= 0.75x: {'met' if t['memory_met'] else 'not met'})")
            if "best_sharded_peer" in t:
                text += (f"; against the fastest sharded peer ({label(t['best_sharded_peer'])}): tokens/s "
                         f"{t['sharded_tokens_ratio']:.2f}x, memory {t['sharded_memory_ratio']:.2f}x")
            if "longest" in t:
                best, best_len = t["best_peer_longest"]
                text += (f"; longest under the cap {t['longest']} vs {best_len} ({label(best)}): "
                         f"{t['longest_ratio']:.2f}x (target >= 2x: {'met' if t['longest_met'] else 'not met'})")
            lines.append(text)
    goal = report.get("checkpoint_targets") or {}
    if goal:
        lines += ["", f"Checkpointing (issue 18) at S = {goal['seq_len']}, against `checkpoint=\"none\"` (the defaults):"]
        for name in [n for n in goal if base_row(n) in BURSTC_ROWS[1:]]:
            t = goal[name]
            text = (f"- {label(name)}: step {t['step_vs_none']:.2f}x none's, activation memory "
                    f"{t['activation_vs_none']:.2f}x, peak {t['peak_mib']:.0f} MiB")
            if "longest" in t:
                text += f"; longest under the cap {t['longest']} ({t['longest_vs_none']:.2f}x none's)"
            if name == "burstc_selective":
                text += (f" (targets: step <= 1.10x {'met' if t['step_met'] else 'not met'}, activation <= 0.60x "
                         f"{'met' if t['activation_met'] else 'not met'})")
            lines.append(text)
        if "selective_vs_torch" in goal:
            v = goal["selective_vs_torch"]
            each = "; ".join(f"{label(n)}: {e['tokens_ratio']:.2f}x its tokens/s at {e['peak_ratio']:.2f}x its peak"
                             for n, e in v["each"].items())
            lines.append(f"- selective against torch's answers on the same sharded model: {each}")
            if v["equal_memory_answer"]:
                lines.append(f"- at equal memory (the fastest of torch's answers within selective's peak, "
                             f"{label(v['equal_memory_answer'])}): {v['equal_memory_tokens_ratio']:.2f}x its "
                             f"tokens/s (target >= 1.10x: {'met' if v['equal_memory_met'] else 'not met'})")
            else:
                lines.append("- at equal memory: none of torch's answers gets down to selective's peak (target met)")
    return "\n".join(lines) + "\n"


def plots(report: dict, directory: Path) -> list[Path]:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("burstc bench: matplotlib is not installed; no plots (pip install matplotlib)", file=sys.stderr)
        return []
    directory.mkdir(parents=True, exist_ok=True)
    written = []
    for key, ylabel, filename in (("tokens_per_s_per_rank", "tokens/s per rank", "bench-throughput.png"),
                                  ("peak_mib_per_rank", "peak MiB per rank", "bench-memory.png")):
        fig, ax = plt.subplots(figsize=(9.5, 4.5))
        for name, row in report["results"].items():
            cells = sorted(row.get("by_seq_len", {}).items())
            if cells:
                style = "-o" if base_row(name) in BURSTC_ROWS else ("--s" if name in SHARDED_PEERS else ":^")
                ax.plot([s for s, _ in cells], [c[key] for _, c in cells], style, label=label(name))
        if key == "peak_mib_per_rank" and report["config"]["memory_cap_mib"]:
            ax.axhline(report["config"]["memory_cap_mib"], color="grey", lw=0.8, label="memory cap")
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("sequence length (tokens)")
        ax.set_ylabel(ylabel)
        ax.set_title(f"{ylabel}, tiny HF Llama training step, P={report['config']['ranks']} gloo ranks (CPU)")
        ax.legend(fontsize=7, loc="center left", bbox_to_anchor=(1.01, 0.5))
        ax.grid(alpha=0.3)
        fig.tight_layout()
        fig.savefig(directory / filename, dpi=110)
        plt.close(fig)
        written.append(directory / filename)
    pareto = checkpoint_pareto(report, plt)
    if pareto is not None:
        pareto.savefig(directory / "bench-checkpoint-pareto.png", dpi=110)
        plt.close(pareto)
        written.append(directory / "bench-checkpoint-pareto.png")
    return written


def pareto_frontier(points: list[tuple]) -> list[tuple]:
    """The ``(time, memory, ...)`` points no other point beats on both (at least as fast and as small, and
    different), by time."""
    return sorted((p for p in points if not any(q[0] <= p[0] and q[1] <= p[1] and q[:2] != p[:2] for q in points)),
                  key=lambda p: p[0])


def checkpoint_pareto(report: dict, plt):
    """Peak memory against step time of burstc's checkpoint rows (and torch's answers on the same model: each
    budget, the SAC policy), one marker per row and sequence length, the frontier per length drawn: the points no
    other point beats on both.  None unless at least two of those rows ran."""
    rows = {name: row for name, row in report["results"].items()
            if base_row(name) in BURSTC_ROWS and row.get("by_seq_len")}
    if len(rows) < 2:
        return None
    fig, ax = plt.subplots(figsize=(10.5, 5))
    seq_lens = sorted({s for row in rows.values() for s in row["by_seq_len"]})
    markers = dict(zip(rows, "osD^vP*XhH<>p8d|_"))
    for color, seq_len in zip(plt.rcParams["axes.prop_cycle"].by_key()["color"], seq_lens):
        points = [(row["by_seq_len"][seq_len]["step_s"], row["by_seq_len"][seq_len]["peak_mib_per_rank"], name)
                  for name, row in rows.items() if seq_len in row["by_seq_len"]]
        for step, peak, name in points:
            ax.scatter(step, peak, color=color, marker=markers[name], s=45,
                       label=f"{label(name)}" if seq_len == seq_lens[0] else None)
        frontier = pareto_frontier(points)
        ax.plot([p[0] for p in frontier], [p[1] for p in frontier], "-", color=color, lw=1,
                label=f"S = {seq_len}: frontier")
    ax.set_xlabel("step time per rank (s)")
    ax.set_ylabel("peak memory per rank (MiB)")
    ax.set_title(f"checkpointing: memory against time, P={report['config']['ranks']} gloo ranks (CPU)")
    ax.legend(fontsize=7, loc="center left", bbox_to_anchor=(1.01, 0.5))  # markers: rows; colours: lengths
    ax.grid(alpha=0.3)
    fig.tight_layout()
    return fig


def sweep(rows: list[str], seq_lens: list[int], args, shape: ModelShape, peak_flops: float,
          progress: _Progress) -> dict[str, dict]:
    """Every row at every length: one P-rank group holds the sharded rows, one single process the one-process rows;
    at each length every row is prepared (warm-up), then the timed steps run in rounds, every row once per round."""
    results: dict[str, dict] = {}
    for row in rows:
        reason = _unavailable(row)
        results[row] = {"skipped": reason} if reason else {"by_seq_len": {}}
        if reason:
            print(f"burstc bench: row {row} skipped: {reason}", file=sys.stderr, flush=True)
    live = [row for row in rows if "skipped" not in results[row]]
    with contextlib.ExitStack() as stack:
        groups = {ranks: stack.enter_context(WorkerGroup(ranks, run_timeout_s=args.timeout_s))
                  for ranks in sorted({_row_ranks(row, args.ranks) for row in live})}
        def failed(row, seq_len, exc):
            first_line = (str(exc).splitlines() or [""])[0][:300]
            results[row] = {"skipped": f"failed at S={seq_len}: {type(exc).__name__}: {first_line}"}
            print(f"burstc bench: row {row} {results[row]['skipped']}", file=sys.stderr, flush=True)
            ranks = _row_ranks(row, args.ranks)
            if not groups[ranks].alive:  # a rank died (or hung): later rows get a fresh group
                groups[ranks] = stack.enter_context(WorkerGroup(ranks, run_timeout_s=args.timeout_s))

        for seq_len in seq_lens:
            cases, prepared, steps = {}, {}, {}
            for row in live:
                if "skipped" in results[row]:
                    continue
                ranks = _row_ranks(row, args.ranks)
                cases[row] = case_of(row, seq_len, args, shape, args.steps)
                try:
                    prepared[row] = groups[ranks].run(prepare_case, cases[row])
                except Exception as exc:
                    failed(row, seq_len, exc)
                    continue
                steps[row] = []
                progress.update(f"{row} S={seq_len}: warm-up {max(p['warmup_s'] for p in prepared[row]):.1f} s")
            for round_ in range(args.steps):
                for row in [r for r in prepared if "skipped" not in results[r]]:
                    try:
                        steps[row].append(groups[cases[row].ranks].run(step_case, row))
                    except Exception as exc:
                        failed(row, seq_len, exc)
                        continue
                    progress.update(f"{row} S={seq_len}: step {round_ + 1}/{args.steps} "
                                    f"{max(r['time_s'] for r in steps[row][-1]):.2f} s")
            for row in prepared:
                if "skipped" not in results[row]:
                    results[row]["by_seq_len"][seq_len] = combine(cases[row], prepared[row], steps[row], peak_flops)
            for group in groups.values():
                if group.alive:
                    group.run(release_cases)
    return results


def emulated_network_help(argv: list[str], ranks: int, mesh: tuple[int, int] | None = None) -> str:
    rest = " ".join(shlex.quote(a) for a in argv if a != "--emulated-network")
    # a mesh: two link classes at the README's calibration for 4 ranks on 2 cores, fp32 standing for bf16
    links = (f"--nodes {mesh[0]} --gpus-per-node {mesh[1]} --intra 101 --inter 11.3" if mesh
             else f"--ranks {ranks} --rate 50")
    return (
        "Run the same benchmark with every gloo rank pair rate-limited (the emulated cluster; as root, with this "
        f"python's bin first on PATH; see its README next to it):\n\n    EC={EMULATED_CLUSTER}\n"
        f"    $EC {links} -- burstc bench {rest}\n\n"
        "(--rate MB/s per ordered rank pair; for two nodes use --nodes N --gpus-per-node G --intra MBPS --inter "
        "MBPS with --ranks N*G.  The ranks are spawned by WorkerGroup through init_process_group(rank=...), which "
        "the tool's hook reads.  The one-process rows send nothing and are unaffected.)")


def source_checkout() -> Path | None:
    """The repository root when burstc runs from its source tree (an editable install), else None."""
    root = Path(__file__).resolve().parents[2]
    return root if (root / "pyproject.toml").is_file() and (root / "benchmarks").is_dir() else None


def _mesh_shape(text: str) -> tuple[int, int]:
    try:
        nodes, per_node = (int(x) for x in text.lower().split("x"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected NxG (nodes x ranks per node, e.g. 2x2), got {text!r}") from None
    if nodes < 1 or per_node < 1:
        raise argparse.ArgumentTypeError(f"a mesh needs at least one node and one rank per node, got {text!r}")
    return nodes, per_node


def _parser() -> argparse.ArgumentParser:
    checkout = source_checkout()
    out_dir = checkout / "benchmarks" / "results" if checkout else Path("burstc-bench")
    plots_dir = checkout / "docs" if checkout else Path("burstc-bench")
    parser = argparse.ArgumentParser(prog="burstc bench", description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--ranks", type=int, default=2, help="gloo ranks of the sharded rows")
    parser.add_argument("--mesh", type=_mesh_shape, default=None, metavar="NxG",
                        help="burstc's rows on an N nodes x G ranks per node mesh (dims named inter, intra: the "
                             "planner picks double ring, hybrid or flat per attention); N x G must equal --ranks; "
                             "the peers' rows stay on the flat world group")
    parser.add_argument("--seq-lens", type=int, nargs="+", default=[1024, 2048, 4096])
    parser.add_argument("--rows", nargs="+", choices=ROWS, default=list(DEFAULT_ROWS),
                        help="default: all but the checkpointing comparison's rows (" + ", ".join(CHECKPOINT_ROWS)
                        + ")")
    parser.add_argument("--steps", type=int, default=2, help="timed steps after the warm-up step")
    parser.add_argument("--dim", type=int, default=ModelShape.dim)
    parser.add_argument("--layers", type=int, default=ModelShape.layers)
    parser.add_argument("--heads", type=int, default=ModelShape.heads)
    parser.add_argument("--kv-heads", type=int, default=ModelShape.kv_heads)
    parser.add_argument("--ffn", type=int, default=ModelShape.ffn)
    parser.add_argument("--vocab", type=int, default=ModelShape.vocab)
    parser.add_argument("--budgets", "--budget", type=float, nargs="+", default=[0.5],
                        help="torch's activation_memory_budget of the rows compile_budget and burstc_torch_budget: "
                             "one row per value (keyed row@value)")
    parser.add_argument("--burstc-backend", choices=["inductor", "aot_eager"], default="inductor",
                        help="burstc.compile's backend (its default: inductor)")
    parser.add_argument("--memory-cap-mib", type=float, default=128.0,
                        help="per-rank memory cap of the longest-sequence search (0: no search)")
    parser.add_argument("--max-seq-len", type=int, default=16384, help="the cap search stops here")
    parser.add_argument("--cap-bisect", type=int, default=0,
                        help="bisection steps after the doubling (0: the longest power-of-two multiple of the sweep)")
    parser.add_argument("--timeout-s", type=float, default=1800.0, help="per case")
    parser.add_argument("--out-dir", type=Path, default=out_dir,
                        help="JSON and Markdown go here (default: benchmarks/results of a source checkout, else "
                             "./burstc-bench)")
    parser.add_argument("--plots-dir", type=Path, default=plots_dir,
                        help="PNG plots go here (default: docs/ of a source checkout, else ./burstc-bench)")
    parser.add_argument("--no-plots", action="store_true")
    parser.add_argument("--no-progress", action="store_true", help="plain lines instead of a progress bar")
    parser.add_argument("--emulated-network", action="store_true",
                        help="print how to run this under the emulated cluster, and exit")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--from-json", type=Path, help="re-derive the ratios, tables and plots of an earlier run's JSON")
    return parser


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = _parser()
    args = parser.parse_args(argv)
    if args.emulated_network:
        print(emulated_network_help(argv, args.ranks, args.mesh))
        return 0
    if args.from_json:
        report = json.loads(args.from_json.read_text())
        for row in report["results"].values():  # JSON made the lengths strings
            row["by_seq_len"] = {int(s): c for s, c in row.get("by_seq_len", {}).items()}
        return write_report(report, args)
    if importlib.util.find_spec("transformers") is None:
        print("burstc bench: the benchmark's model is transformers' LlamaForCausalLM, and transformers is not "
              "installed; pip install 'burstc[bench]' (or transformers)", file=sys.stderr)
        return 2
    shape = ModelShape(args.dim, args.layers, args.heads, args.kv_heads, args.ffn, args.vocab)
    if args.dim % args.heads or (args.dim // args.heads) % 2 or args.heads % args.kv_heads:
        parser.error("--dim must split into --heads heads of even size, and --heads must be a multiple of --kv-heads")
    bad = [s for s in args.seq_lens if s % (2 * args.ranks)]
    if bad or args.ranks < 2:
        parser.error(f"need --ranks >= 2 and lengths that are multiples of 2 x ranks (zigzag); got {bad or args.ranks}")
    if args.mesh and args.mesh[0] * args.mesh[1] != args.ranks:
        parser.error(f"--mesh {args.mesh[0]}x{args.mesh[1]} has {args.mesh[0] * args.mesh[1]} ranks, --ranks is "
                     f"{args.ranks}")
    rows = [r for r in ROWS if r in args.rows]
    if "eager" not in rows:
        rows.append("eager")  # the reference of the loss and gradient columns
    peak_flops = measure_cpu_peak_flops()
    machine = {"cpus": os.cpu_count(), "load_start": os.getloadavg()[0], "torch": torch.__version__,
               "peak_gflops": peak_flops / 1e9,
               "peak_method": "best of 10 fp32 1024^3 torch.mm on one thread, measured at the start"}
    seq_lens = sorted(set(args.seq_lens))
    progress = _Progress(len(expand_rows(rows, args.budgets)) * len(seq_lens) * (1 + args.steps),
                         not args.no_progress)
    started = time.perf_counter()
    results = sweep(expand_rows(rows, args.budgets), seq_lens, args, shape, peak_flops, progress)
    if args.memory_cap_mib > 0:
        for row, entry in results.items():
            if "by_seq_len" in entry:
                base = case_of(row, 0, args, shape, 1)
                entry["longest_under_cap"] = longest_under_cap(
                    base, entry["by_seq_len"], args.memory_cap_mib, max_seq_len=args.max_seq_len,
                    bisect=args.cap_bisect, timeout_s=args.timeout_s, peak_flops=peak_flops, progress=progress)
    progress.close()
    machine["load_end"] = os.getloadavg()[0]
    config = {"ranks": args.ranks, "mesh": args.mesh, "seq_lens": seq_lens, "rows": rows, "steps": args.steps,
              "shape": dataclasses.asdict(shape), "budgets": args.budgets, "burstc_backend": args.burstc_backend,
              "memory_cap_mib": args.memory_cap_mib, "max_seq_len": args.max_seq_len, "cap_bisect": args.cap_bisect,
              "command": " ".join(["burstc bench"] + [shlex.quote(a) for a in argv]),
              "wall_s": time.perf_counter() - started}
    return write_report({"config": config, "machine": machine, "results": results}, args)


def write_report(report: dict, args) -> int:
    """Ratios, errors and targets from the raw numbers, then the JSON, the Markdown table and the plots."""
    results = report["results"]
    errors_vs_eager(results)
    ratios(results)
    report["targets"] = targets(results)
    report["checkpoint_targets"] = checkpoint_targets(results)
    args.out_dir.mkdir(parents=True, exist_ok=True)
    (args.out_dir / "end_to_end.json").write_text(json.dumps(report, indent=2, default=str))
    table = markdown(report)
    (args.out_dir / "end_to_end.md").write_text(table)
    print(table)
    written = [] if args.no_plots else plots(report, args.plots_dir)
    print(f"wrote {args.out_dir / 'end_to_end.json'}, {args.out_dir / 'end_to_end.md'}"
          + "".join(f", {p}" for p in written) + f" (the run took {report['config']['wall_s']:.0f} s)")
    return 0

if __name__ == "__main__":
    raise SystemExit(main())
