"""Per-rank peak memory of a training step: a measurement helper and a model that predicts it.

Measurement (:func:`measure_peak`): the real peak of a region of code, per process (= per rank).  On CPU the
kernel's high-water mark of resident memory: ``/proc/self/clear_refs`` ("5") resets ``VmHWM`` to the current
``VmRSS`` at entry (after ``malloc_trim``, so memory the allocator merely cached is not in the baseline) and
``VmHWM`` is read at exit; on CUDA the caching allocator's ``max_memory_allocated`` after
``reset_peak_memory_stats``.  Either way the result is the bytes above what was resident at entry.  On CPU,
:func:`exact_cpu_peaks` (or ``MALLOC_MMAP_THRESHOLD_=65536``) makes the resident set follow the live tensors.

Model (:func:`predict_step`): the peak of one forward + backward of a compiled graph, from the AOT forward
and backward graphs burstc keeps in the report.  Every value of the two graphs has its shape and dtype in
``node.meta["val"]``, so the model replays both graphs in order and keeps the live bytes: a value is
allocated where it is made (views and ``getitem``s share their base's storage), freed after its last use, and
what the forward returns for the backward (the saved activations) stays live until the backward has used it
-- until the backward's end under ``aot_eager`` (its boxed call holds its argument list), at the last use
under Inductor (its boxed call clears the list).  The backward's outputs are the parameter gradients, kept.
This covers any model: parameters, gradients, activations per layer (their sizes are whatever B, S/P,
hidden, heads, KV heads, head dim, intermediate size and dtype make them), and what each checkpoint mode
saves and recomputes (``checkpoint="layers"`` recomputes a layer inside the backward graph: the replay sees
its activations come and go).  What no graph shows are the buffers inside burstc's opaque ops; hand formulas
add them as a transient at the op's node (:data:`OP_BUFFERS`): the ring attention's double-buffered arriving
K/V (or Q, dO, LSE, delta) shards, its fp32 accumulators and partial-gradient buffers
(:mod:`burstc.ops.ring_loops`), and the fused LM-head loss's chunk of logits
(:mod:`burstc.kernels.linear_cross_entropy`).

Not modelled: the optimizer step's own temporaries (its state is counted when an optimizer is given), the
allocator's rounding and fragmentation, memory outside torch tensors (on CPU, ``VmHWM`` counts every byte the
process touches).  Under Inductor the replay follows what its scheduler did (:func:`inductor_schedule`): the
kernels' order, which values got buffers, and the last kernel reading each; under ``aot_eager``, and when
Inductor's cache served a graph, the FX graph's order (README, "Memory").
"""
from __future__ import annotations

import bisect
import contextlib
import ctypes
import ctypes.util
import dataclasses
import functools
import operator
import re
from typing import Iterator

import torch
import torch.fx as fx

# --------------------------------------------------------------------------------------------------------------
# measurement


@dataclasses.dataclass
class PeakMemory:
    """What :func:`measure_peak` saw: ``extra_bytes`` above what was resident at entry, the peak itself
    (``peak_bytes``: the process's ``VmHWM`` on CPU, the allocated bytes on CUDA) and the baseline."""

    device: str
    method: str
    baseline_bytes: int = 0
    peak_bytes: int = 0

    @property
    def extra_bytes(self) -> int:
        return max(0, self.peak_bytes - self.baseline_bytes)


def _proc_status_bytes(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"burstc.memory: /proc/self/status has no {field} line")


def _release_cached_heap() -> None:
    """Hand the heap memory glibc keeps after ``free`` back to the kernel, so that the baseline is what is
    in use (no-op where glibc is not the C library)."""
    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name) if name else None
        trim = getattr(libc, "malloc_trim", None)
    except OSError:
        trim = None
    if trim is not None:
        trim(0)


def exact_cpu_peaks(threshold_bytes: int = 64 * 2**10) -> bool:
    """From now on in this process, glibc gives every allocation above ``threshold_bytes`` its own mapping and
    unmaps it when freed, so the resident set (and ``VmHWM``) follows the live tensors.  By default glibc
    raises that threshold as blocks are freed (up to 32 MiB) and keeps freed blocks below it in its heap,
    so a step's ``VmHWM`` also counts cached free memory: the same step measured 126-153 MiB where its
    tensors need ~110 MiB (with this: 110-111).  Costs a page fault per first touch of a large tensor.
    Same as starting the process with ``MALLOC_MMAP_THRESHOLD_=65536``.  False where glibc is absent."""
    name = ctypes.util.find_library("c")
    try:
        mallopt = getattr(ctypes.CDLL(name), "mallopt", None) if name else None
    except OSError:
        mallopt = None
    m_mmap_threshold = -3  # <malloc.h>
    return bool(mallopt is not None and mallopt(m_mmap_threshold, int(threshold_bytes)))


def _reset_cpu_high_water_mark() -> None:
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # 5: reset the peak resident set size (VmHWM) to the current one
    except OSError as err:
        raise RuntimeError(f"burstc.memory.measure_peak: cannot reset the peak resident memory "
                           f"(/proc/self/clear_refs: {err}); CPU measurement needs Linux procfs") from err


@contextlib.contextmanager
def measure_peak(device: torch.device | str | None = None) -> Iterator[PeakMemory]:
    """``with measure_peak() as peak: step()`` then ``peak.extra_bytes``: the peak memory of the region above
    what was resident at entry, in this process (one rank).  ``device``: ``"cpu"`` (default when CUDA is not
    available) or a CUDA device (default ``torch.cuda.current_device()`` when available)."""
    if device is None:
        device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else "cpu"
    device = torch.device(device)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        result = PeakMemory(str(device), "cuda.max_memory_allocated", torch.cuda.memory_allocated(device))
        try:
            yield result
        finally:
            torch.cuda.synchronize(device)
            result.peak_bytes = torch.cuda.max_memory_allocated(device)
        return
    if device.type != "cpu":
        raise ValueError(f"burstc.memory.measure_peak: unsupported device {device}")
    _release_cached_heap()
    _reset_cpu_high_water_mark()
    result = PeakMemory("cpu", "VmHWM", _proc_status_bytes("VmRSS"))
    try:
        yield result
    finally:
        result.peak_bytes = _proc_status_bytes("VmHWM")


# --------------------------------------------------------------------------------------------------------------
# the graph replay

ACC_BYTES = 4  # fp32: the ring's accumulators and partial gradients, the fused loss's per-token buffers


def _tensors(value) -> list:
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, (tuple, list)):
        return [t for v in value for t in _tensors(v)]
    return []


def _nbytes(t: torch.Tensor) -> int:
    try:
        return int(t.untyped_storage().nbytes())
    except (NotImplementedError, RuntimeError, AttributeError):
        return t.numel() * t.element_size()


# ops whose result is (a view of) an input's storage though their schema does not say so
_ALIASING_TARGETS = {"aten._unsafe_view.default", "_c10d_functional.wait_tensor.default"}


def _aliases_first_input(node: fx.Node) -> bool:
    """Whether ``node``'s outputs share the storage of its first tensor argument (views, in-place ops)."""
    target = node.target
    if str(target) in _ALIASING_TARGETS:
        return True
    schema = getattr(target, "_schema", None)
    return schema is not None and any(r.alias_info is not None for r in schema.returns)


def _first_tensor_arg(node: fx.Node) -> fx.Node | None:
    for a in node.args:
        if isinstance(a, fx.Node) and _tensors(a.meta.get("val")):
            return a
    return None


def bound_args(node: fx.Node) -> dict:
    """``node``'s arguments by schema name (an op overload's positional and keyword arguments)."""
    schema = node.target._schema
    bound = {arg.name: (node.args[i] if i < len(node.args) else node.kwargs.get(arg.name, arg.default_value))
             for i, arg in enumerate(schema.arguments)}
    return {k: (v.meta.get("val") if isinstance(v, fx.Node) else v) for k, v in bound.items()}


@dataclasses.dataclass
class GraphReplay:
    """Live bytes while one graph runs, counting only the storages the step itself allocates."""

    peak_bytes: int = 0
    peak_node: str = ""
    peak_op_buffers: int = 0
    end_bytes: int = 0
    # storages live at the peak: {storage key: bytes}
    live_at_peak: dict = dataclasses.field(default_factory=dict)


class _Storages:
    """Storage keys across the forward and backward graphs: ``(graph tag, node name, output index)``."""

    def __init__(self):
        self.bytes: dict[tuple, int] = {}
        self.counted: set[tuple] = set()  # allocated by the step (not the caller's parameters and inputs)


class KernelSchedule(dict):
    """What Inductor's scheduler did with one graph (:func:`inductor_schedule`): as a dict, FX node name -> position
    of the first kernel that computes it; ``materialized``: the FX nodes whose value Inductor keeps in a buffer of
    its own (the others were fused into the kernels that read them); ``last_reads``: FX node name (a materialized
    node, or a graph input) -> position of the last kernel that reads its buffer (a kernel that recomputes a fused
    pointwise op reads that op's inputs, so they live as long as that kernel's)."""

    def __init__(self):
        super().__init__()
        self.materialized: set[str] = set()
        self.last_reads: dict[str, int] = {}


def _fx_origin(ir_node, positions: dict[str, int]) -> str | None:
    """The FX node an Inductor buffer holds the value of: its origin node, else the latest of its origins."""
    origin = getattr(ir_node, "origin_node", None)
    if origin is not None:
        return origin.name
    names = [o.name for o in (getattr(ir_node, "origins", None) or ()) if o.name in positions]
    return max(names, key=lambda n: positions[n]) if names else None


def _record_kernels(scheduler, schedule: KernelSchedule, removed: set[str]) -> None:
    for index, snode in enumerate(scheduler.nodes):
        for part in snode.get_nodes():
            for origin in getattr(getattr(part, "node", None), "origins", None) or ():
                schedule.setdefault(getattr(origin, "name", ""), index)
    holds: dict[str, str] = {}  # Inductor buffer name -> FX node name
    for snode in scheduler.nodes:
        for part in snode.get_nodes():
            for buf in part.get_outputs():
                origin = _fx_origin(buf.node, schedule)
                if origin is not None and buf.get_name() not in removed:
                    holds[buf.get_name()] = origin
                    schedule.materialized.add(origin)
    for index, snode in enumerate(scheduler.nodes):
        for dep in snode.read_writes.reads:
            name = holds.get(dep.name, dep.name)  # graph inputs keep their FX names
            schedule.last_reads[name] = max(schedule.last_reads.get(name, -1), index)


@contextlib.contextmanager
def inductor_schedule() -> Iterator[KernelSchedule]:
    """While Inductor compiles a graph inside, fill the yielded :class:`KernelSchedule`: the order its scheduler
    runs the graph's FX nodes in (after fusion and Inductor's own reordering, which runs some weight-gradient
    matmuls later than the FX order and so keeps what they read alive longer), which values get buffers, and
    the last kernel reading each.  Empty when Inductor's cache served the graph (no scheduling ran)."""
    from torch._inductor.scheduler import Scheduler
    from torch._inductor.virtualized import V

    schedule = KernelSchedule()
    original = Scheduler.codegen

    def codegen(scheduler):
        result = original(scheduler)
        # after codegen: the buffers fusion removed (read and written inside one kernel only) are known
        removed = set(getattr(V.graph, "removed_buffers", ())) | set(getattr(V.graph, "inplaced_to_remove", ()))
        _record_kernels(scheduler, schedule, removed)
        return result

    Scheduler.codegen = codegen
    try:
        yield schedule
    finally:
        Scheduler.codegen = original


def _scheduled_keys(gm: fx.GraphModule, schedule: dict[str, int]) -> dict[fx.Node, int]:
    """Each node's kernel position: the schedule's, or (a node it does not name: a view, a getitem, one Inductor
    never materializes) its latest input's."""
    nodes = list(gm.graph.nodes)
    key: dict[fx.Node, int] = {}
    for node in nodes:
        known = schedule.get(node.name)
        after = max((key[arg] for arg in node.all_input_nodes), default=-1)
        key[node] = max(known, after) if known is not None else after
        if node.op == "output":
            key[node] = len(schedule) + len(nodes)
    return key


def _order_by(gm: fx.GraphModule, key: dict[fx.Node, int]) -> list[fx.Node]:
    nodes = list(gm.graph.nodes)
    position = {node: i for i, node in enumerate(nodes)}
    return sorted(nodes, key=lambda n: (key[n], position[n]))


def scheduled_order(gm: fx.GraphModule, schedule: dict[str, int] | None) -> list[fx.Node]:
    """``gm``'s nodes in ``schedule``'s order (:func:`inductor_schedule`); a node the schedule does not name runs
    right after its inputs.  Ties keep the graph's order, so the result stays topological.  ``None`` or empty:
    the graph's order."""
    if not schedule:
        return list(gm.graph.nodes)
    return _order_by(gm, _scheduled_keys(gm, schedule))


def replay(gm: fx.GraphModule, storages: _Storages, tag: str, *, inputs: dict[str, list] | None = None,
           inputs_freed: bool = False, op_buffers=None, schedule: dict[str, int] | None = None,
           order: list[fx.Node] | None = None, ahead_buffers=None) -> tuple[GraphReplay, dict[str, list]]:
    """Replay ``gm``: -> (its :class:`GraphReplay`, {output node name: storage keys}).

    ``inputs`` maps a placeholder's name to the storage keys it holds (the forward's saved values, for the
    backward); other placeholders are the caller's (not counted).  ``inputs_freed``: a counted input is freed
    after its last use (Inductor) instead of at the graph's end (aot_eager).  ``op_buffers(node) -> bytes``:
    what an opaque op allocates inside, live only while it runs.  ``schedule``: the order Inductor ran the nodes in
    (:func:`scheduled_order`), else ``order`` (every node of the graph, in the order to replay), else the graph's.
    ``ahead_buffers(order) -> [bytes per node]``: what ops hold *before* they run, live at the nodes it names
    (:func:`prefetch_ahead`)."""
    inputs = inputs or {}
    keys: dict[fx.Node, list] = {}
    step_keys = _scheduled_keys(gm, schedule) if schedule else None
    if step_keys is not None:
        order = _order_by(gm, step_keys)
    elif order is None:
        order = list(gm.graph.nodes)
    kernels = schedule if isinstance(schedule, KernelSchedule) and schedule.materialized else None

    def fused_away(node, outs) -> bool:
        return (kernels is not None and node.op == "call_function" and len(outs) == 1
                and node.name in kernels and node.name not in kernels.materialized
                and not any(u.op == "output" for u in node.users))
    for node in order:
        outs = _tensors(node.meta.get("val"))
        if node.op == "placeholder":
            if node.name in inputs:
                keys[node] = list(inputs[node.name])
            else:
                keys[node] = [(tag, node.name, i) for i in range(len(outs))]
                for i, t in enumerate(outs):
                    storages.bytes[keys[node][i]] = _nbytes(t)
        elif node.op == "call_function" and node.target is operator.getitem:
            parent = keys.get(node.args[0], [])
            index = node.args[1]
            keys[node] = [parent[index]] if isinstance(index, int) and index < len(parent) else []
        elif node.op in ("call_function", "call_method") and _aliases_first_input(node):
            base = _first_tensor_arg(node)
            keys[node] = keys.get(base, [])[:1] * len(outs) if base is not None else []
        elif fused_away(node, outs):
            keys[node] = []  # Inductor computes it inside the kernels that read it: no buffer
        elif node.op in ("call_function", "call_method", "call_module"):
            keys[node] = [(tag, node.name, i) for i in range(len(outs))]
            for i, t in enumerate(outs):
                storages.bytes[keys[node][i]] = _nbytes(t)
                storages.counted.add(keys[node][i])
        else:
            keys[node] = []
    returned: dict[str, list] = {}
    last_use: dict[tuple, int] = {}
    for index, node in enumerate(order):
        for key in keys[node]:
            last_use[key] = max(last_use.get(key, index), index)
        for arg in node.all_input_nodes:
            for key in keys.get(arg, []):
                last_use[key] = max(last_use.get(key, index), index)
        if node.op == "output":
            for arg in node.all_input_nodes:
                returned[arg.name] = keys.get(arg, [])
                for key in keys.get(arg, []):
                    last_use[key] = len(order)  # kept past the graph
        if node.op == "placeholder" and not inputs_freed:
            for key in keys[node]:
                last_use[key] = len(order)
    if kernels is not None:
        # a buffer lives until the last kernel that reads it, which can be later than its last FX user: a fused
        # kernel recomputes the pointwise ops it absorbed from their inputs
        steps = [step_keys[node] for node in order]
        for node in order:
            last_kernel = kernels.last_reads.get(node.name)
            if last_kernel is None:
                continue
            until = bisect.bisect_right(steps, last_kernel) - 1  # the last node that runs in or before that kernel
            for key in keys[node]:
                if last_use.get(key, -1) < until:
                    last_use[key] = until
    live = {key: storages.bytes[key] for arg in inputs.values() for key in arg if key in storages.counted}
    live_bytes = sum(live.values())
    frees: dict[int, list] = {}  # node index -> keys whose last use it is
    for key, index in last_use.items():
        frees.setdefault(index, []).append(key)
    result = GraphReplay()
    ahead = ahead_buffers(order) if ahead_buffers is not None else [0] * len(order)
    made: set[tuple] = set(live)
    for index, node in enumerate(order):
        for key in keys[node]:
            if key not in made:
                made.add(key)
                if key in storages.counted:
                    live[key] = storages.bytes[key]
                    live_bytes += live[key]
        extra = (op_buffers(node) if op_buffers is not None and node.op == "call_function" else 0) + ahead[index]
        if live_bytes + extra > result.peak_bytes:
            result.peak_bytes, result.peak_node, result.peak_op_buffers = live_bytes + extra, node.name, extra
            result.live_at_peak = dict(live)
        for key in frees.get(index, ()):
            live_bytes -= live.pop(key, 0)
    result.end_bytes = live_bytes
    return result, returned


# --------------------------------------------------------------------------------------------------------------
# what the graphs do not show: buffers inside burstc's opaque ops (hand formulas, live while the op runs)


@functools.lru_cache(maxsize=1 << 16)  # ring_backward_buffers asks per layer, rank and step (explain: 129K calls)
def _rows_runs(queries_travel: bool, layout: str, mask, receiver: int, sender: int, local_len: int, world_size: int):
    from burstc.block_geometry import runs_length, travelling_rows

    runs = travelling_rows(queries_travel, layout, mask.static_part, receiver, sender, local_len, world_size)
    return runs_length(runs)


@functools.lru_cache(maxsize=4096)  # every layer of a model asks the same (explain's 64 ranks x 32 layers)
def _arrival_bytes(queries_travel: bool, layout, mask, rank: int, local_len: int, world_size: int, row_bytes: int):
    """The ring's arriving buffers on ``rank`` (:class:`burstc.ops.ring_loops._Arrivals`): per parity of the
    step, a compact buffer of the rows received plus, when they are not the whole shard, the whole-shard
    buffer they are unpacked into; and the largest compact copy of the rows sent."""
    per_parity, sent = [0, 0], 0
    for step in range(1, world_size):
        received = _rows_runs(queries_travel, layout, mask, rank, (rank - step) % world_size, local_len, world_size)
        held = received * row_bytes + (local_len * row_bytes if 0 < received < local_len else 0)
        per_parity[step % 2] = max(per_parity[step % 2], held)
        sends = _rows_runs(queries_travel, layout, mask, (rank + step) % world_size, rank, local_len, world_size)
        sent = max(sent, sends * row_bytes if 0 < sends < local_len else 0)
    return sum(per_parity) + sent


@functools.lru_cache(maxsize=4096)
def _rank_blocks(layout, static_mask, local_len: int, world_size: int, rank: int, queries_travel: bool
                 ) -> tuple[tuple[int, int, int, bool], ...]:
    """``(step, query rows, key rows, on the element-wise POSITIONS path)`` of every block ``rank`` computes,
    step by step (the one walk both estimates below read)."""
    from burstc.block_geometry import POSITIONS, blocks

    found = []
    for step in range(world_size):
        other = (rank - step) % world_size
        q_owner, kv_owner = (other, rank) if queries_travel else (rank, other)
        for block in blocks(layout, static_mask, q_owner, kv_owner, local_len, world_size):
            found.append((step, block.q_stop - block.q_start, block.kv_stop - block.kv_start,
                          block.mask == POSITIONS))
    return tuple(found)


def _largest_block_rows(layout, mask, local_len: int, world_size: int, rank: int, queries_travel: bool | None):
    """(query rows, key rows) of the largest block ``rank`` computes after step 0 (both 0 on one rank)."""
    walk = _rank_blocks(layout, mask.static_part, local_len, world_size, rank, bool(queries_travel))
    return max(((q, kv) for step, q, kv, _ in walk if step > 0), key=lambda r: r[0] + r[1], default=(0, 0))


def _masked_block_rows(layout, mask, local_len: int, world_size: int, rank: int, queries_travel: bool
                       ) -> tuple[int, int]:
    """(query rows, key rows) of the largest block ``rank`` may run on the element-wise masked kernel
    (:mod:`burstc.kernels.masked_attention_blocks`), (0, 0) if none: with runtime terms or score mods any block
    (the data decide which), else the static :data:`~burstc.block_geometry.POSITIONS` blocks."""
    any_block = bool(mask.runtime_terms or mask.score_mods)
    walk = _rank_blocks(layout, mask.static_part, local_len, world_size, rank, bool(queries_travel))
    return max(((q, kv) for _, q, kv, positions in walk if any_block or positions), key=lambda r: r[0] * r[1],
               default=(0, 0))


def masked_kernel_bytes(op: str, spec, q_rows: int, kv_rows: int, batch: int, heads_q: int, heads_kv: int,
                        head_dim: int, elem: int) -> int:
    """Bytes one call of the masked block kernel holds on a ``q_rows`` x ``kv_rows`` block (``op``: "forward" or
    "backward"): its fp32 score chunks alive at once, K and V repeated to the query heads in fp32 (unless they
    are already), and its fp32 results (out and lse; dq, and dk, dv at the query heads, before folding)."""
    from burstc.attention_ir import SoftCap
    from burstc.kernels.masked_attention_blocks import temporary_bytes

    if q_rows == 0:
        return 0
    scores = temporary_bytes(op, batch, heads_q, q_rows, kv_rows, spec.term(SoftCap) is not None)
    kv_copies = 0 if heads_q == heads_kv and elem == ACC_BYTES else 2 * batch * heads_q * kv_rows * head_dim * ACC_BYTES
    if op == "forward":
        results = batch * heads_q * q_rows * (head_dim + 1) * ACC_BYTES
    else:
        results = batch * heads_q * (q_rows + 2 * kv_rows) * head_dim * ACC_BYTES
    return scores + kv_copies + results


def ring_forward_buffers(q, k, v, layout: str, mask: str, world_size: int) -> int:
    """Bytes :func:`burstc.ops.ring_loops.ring_forward` holds beyond its outputs, on its busiest rank: copies of
    non-contiguous K/V, the two arriving K/V sets, the fp32 output accumulator (when the output is not fp32),
    and one block's output with the merge's two fp32 temporaries (and fp32 copies of low-precision inputs)."""
    from burstc.attention_ir import MaskSpec
    from burstc.ops.head_groups import shard_head_groups

    spec = MaskSpec.decode(mask)
    batch, heads_q, local_len, head_dim = q.shape
    heads_kv, elem = k.shape[1], q.element_size()
    # batch groups: index-gathered rows of q, k, v, at most one copy over all groups (may_run_batch_groups)
    gathered = sum(t.numel() * t.element_size() for t in (q, k, v)) if may_run_batch_groups(spec, batch) else 0
    groups = shard_head_groups(*k.shape, k.element_size(), world_size, bool(spec.score_mods))
    # a head group's buffers: two groups' are alive at once (burstc.ops.head_groups), each 1/groups of them
    heads_q, heads_kv = heads_q * min(2, groups) // groups, heads_kv * min(2, groups) // groups
    kv_row = 2 * batch * heads_kv * head_dim * elem
    sliced_copy = groups > 1 and batch > 1  # a group's heads of a [B, H, S, D] tensor are contiguous when B = 1
    home = 0 if k.is_contiguous() and v.is_contiguous() and not sliced_copy else local_len * kv_row
    # a loop's result is copied into the whole outputs when the call runs as more than one loop
    several_loops = groups > 1 or gathered > 0
    accumulator = batch * heads_q * local_len * head_dim * ACC_BYTES if elem != ACC_BYTES or several_loops else 0
    worst = 0
    for rank in range(world_size):
        q_rows, kv_rows = _largest_block_rows(layout, spec, local_len, world_size, rank, False)
        block = 3 * batch * heads_q * q_rows * head_dim * ACC_BYTES
        if elem != ACC_BYTES:  # the CPU flash kernel runs low-precision blocks in fp32
            block += batch * (heads_q * q_rows + 2 * heads_kv * kv_rows) * head_dim * ACC_BYTES
        arrivals = _arrival_bytes(False, layout, spec, rank, local_len, world_size, kv_row)
        masked = masked_kernel_bytes("forward", spec, *_masked_block_rows(layout, spec, local_len, world_size, rank,
                                                                          False), batch, heads_q, heads_kv, head_dim,
                                     elem)
        worst = max(worst, home + arrivals + accumulator + max(block, masked))
    return gathered + worst


def may_run_batch_groups(spec, batch: int) -> bool:
    """Whether a call may run as batch groups (:mod:`burstc.ops.batch_groups`): key padding over more than one
    batch row, the groups decided at run time.  The estimate then counts, at most, one gathered copy of the op's
    inputs (a group of rows that are not consecutive is an index-gathered copy, all groups together copy the
    inputs at most once) and each loop's results copied into the whole outputs; each loop's own buffers shrink to
    its group's rows (two consecutive loops together hold at most the whole batch's share), so the rest stands."""
    from burstc.attention_ir import KeyPadding

    return batch > 1 and spec.term(KeyPadding) is not None


def ring_backward_buffers(grad_out, q, k, v, layout: str, mask: str, plan: str, world_size: int) -> int:
    """Bytes :func:`burstc.ops.ring_loops.ring_backward` holds beyond its outputs, on its busiest rank: the
    fp32 gradient accumulators (when the inputs are not fp32), delta (``burst`` plan), copies of
    non-contiguous inputs, the two arriving sets of the travelling side, up to two fp32 partial gradients of
    visitors and the buffer of own gradients returning, and one block's gradients."""
    from burstc.attention_ir import MaskSpec
    from burstc.ops.head_groups import shard_head_groups
    from burstc.ops.ring_attention import resolve_plan

    spec = MaskSpec.decode(mask)
    batch, heads_q, local_len, head_dim = q.shape
    heads_kv, elem = k.shape[1], q.element_size()
    queries_travel = resolve_plan(plan, q, k, world_size, layout, spec) == "burst"
    q_bytes = batch * heads_q * local_len * head_dim * elem
    rows_bhs = batch * heads_q * local_len * ACC_BYTES
    # batch groups gather grad_out, q, k, v, out (q's size) and the lse and delta rows (fp32 [B, Hq, S] each)
    gathered = 0
    if may_run_batch_groups(spec, batch):
        gathered = sum(t.numel() * t.element_size() for t in (grad_out, q, k, v, q)) + 2 * rows_bhs
    total = gathered + (0 if grad_out.is_contiguous() else q_bytes)
    if queries_travel:  # delta = rowsum(out * dO) travels (whole heads, before the groups), its product a transient
        total += rows_bhs + q_bytes * ACC_BYTES // elem
    groups = shard_head_groups(*k.shape, k.element_size(), world_size, bool(spec.score_mods))
    # the loops run per head group (burstc.ops.head_groups): two groups' buffers alive at once, each 1/groups of
    # the heads; a group's fp32 gradients are its own (copied into the whole outputs as it finishes)
    heads_q, heads_kv = heads_q * min(2, groups) // groups, heads_kv * min(2, groups) // groups
    q_bytes = batch * heads_q * local_len * head_dim * elem
    kv_bytes = batch * heads_kv * local_len * head_dim * elem
    several_loops = groups > 1 or gathered > 0  # each loop's fp32 gradients, copied into the whole outputs
    total += 0 if elem == ACC_BYTES and not several_loops else (q_bytes + 2 * kv_bytes) * ACC_BYTES // elem
    sliced_copy = groups > 1 and batch > 1  # a group's heads of a [B, H, S, D] tensor are contiguous when B = 1
    if queries_travel:
        total += 0 if q.is_contiguous() and not sliced_copy else q_bytes
        row = batch * heads_q * (2 * head_dim * elem + 2 * ACC_BYTES)
        grad_row = batch * heads_q * head_dim * ACC_BYTES
    else:
        total += 0 if k.is_contiguous() and v.is_contiguous() and not sliced_copy else 2 * kv_bytes
        row = 2 * batch * heads_kv * head_dim * elem
        grad_row = 2 * batch * heads_kv * head_dim * ACC_BYTES
    worst = 0
    for rank in range(world_size):
        arrivals = _arrival_bytes(queries_travel, layout, spec, rank, local_len, world_size, row)
        partials = min(2, world_size - 1) * local_len * grad_row
        returning = max((_rows_runs(queries_travel, layout, spec, (rank + s) % world_size, rank, local_len,
                                    world_size) for s in range(1, world_size)), default=0) * grad_row
        q_rows, kv_rows = _largest_block_rows(layout, spec, local_len, world_size, rank, queries_travel)
        q_rows, kv_rows = max(q_rows, local_len), max(kv_rows, local_len)  # step 0's diagonal block is whole
        block = batch * (heads_q * q_rows + 2 * heads_kv * kv_rows) * head_dim * elem
        masked = masked_kernel_bytes("backward", spec, *_masked_block_rows(layout, spec, local_len, world_size, rank,
                                                                           queries_travel), batch, heads_q, heads_kv,
                                     head_dim, elem)
        worst = max(worst, arrivals + partials + returning + max(block, masked))
    return total + worst


def fused_loss_buffers(hidden, weight, chunk_size: int, with_grads: bool) -> int:
    """Bytes the chunked fused LM-head loss (:mod:`burstc.kernels.linear_cross_entropy`) holds beyond its outputs:
    one chunk of logits ``[C, V]``, the per-token loss and lse vectors, and in low precision the fp32 softmax
    block, the weight-gradient partial and staging buffers and the fp32 accumulator's half outside the
    gradient."""
    from burstc.kernels import linear_cross_entropy as kernel

    hidden_size = hidden.shape[-1]
    tokens = hidden.numel() // max(hidden_size, 1)
    vocab, elem = weight.shape[0], hidden.element_size()
    chunk = max(1, min(int(chunk_size), tokens))
    total = chunk * vocab * elem + 2 * tokens * ACC_BYTES
    if elem < ACC_BYTES:
        total += kernel._SOFTMAX_BLOCK_ROWS * vocab * ACC_BYTES
        if with_grads:
            total += kernel._WEIGHT_GRAD_PARTIAL_BYTES + kernel._WEIGHT_GRAD_STAGING_BYTES
            total += vocab * hidden_size * (ACC_BYTES - elem)
    return total


def two_level_ring_buffers(group_names, q, k, plan: str | None, backward: bool) -> int:
    """What a two-level ring adds to the flat ring's buffers (an upper bound by formula, not measured): the
    double ring (two group names) two more whole-shard sets for the lane blocks, and in the backward two fp32
    lane-gradient accumulators; the hybrid (``["ulysses", intra, inter]``) its node-view copies and the
    all-to-alls' send and receive buffers (each tensor it trades, twice)."""
    batch, heads_q, local_len, head_dim = q.shape
    heads_kv, elem = k.shape[1], q.element_size()
    q_bytes, kv_bytes = batch * heads_q * local_len * head_dim * elem, batch * heads_kv * local_len * head_dim * elem
    lse_bytes = batch * heads_q * local_len * ACC_BYTES
    if len(group_names) == 2:  # the double ring
        queries_travel = backward and plan == "burst"
        side = 2 * q_bytes + 2 * lse_bytes if queries_travel else 2 * kv_bytes
        grads = (q_bytes if queries_travel else 2 * kv_bytes) * ACC_BYTES // elem
        return 2 * side + (2 * grads if backward else 0)
    if len(group_names) == 3:  # the hybrid
        traded = q_bytes + 2 * kv_bytes + q_bytes + lse_bytes  # q, k, v in; out, lse back
        if backward:
            traded += 2 * q_bytes + lse_bytes + q_bytes + 2 * kv_bytes  # grad_out, out, lse in; dq, dk, dv back
        return 2 * traded
    return 0


def op_buffers(world_size: int):
    """``node -> bytes`` for :func:`replay`: :func:`ring_forward_buffers`, :func:`ring_backward_buffers` and
    :func:`fused_loss_buffers` at burstc's opaque ops, 0 elsewhere."""

    def buffers(node: fx.Node) -> int:
        name = str(node.target)
        if not name.startswith("burstc."):
            return 0
        args = bound_args(node)
        if name == "burstc.ring_attention_forward.default":
            return ring_forward_buffers(args["q"], args["k"], args["v"], args["layout"], args["mask"], world_size) \
                + two_level_ring_buffers(args["group_names"], args["q"], args["k"], None, backward=False)
        if name == "burstc.ring_attention_backward.default":
            return ring_backward_buffers(args["grad_out"], args["q"], args["k"], args["v"], args["layout"],
                                         args["mask"], args["plan"], world_size) \
                + two_level_ring_buffers(args["group_names"], args["q"], args["k"], args["plan"], backward=True)
        if name == "burstc.ring_attention_backward_prefetch.default":
            return prefetch_buffers(args["q"], args["k"], args["v"], args["layout"], args["mask"], args["plan"],
                                    world_size)
        if name.startswith("burstc.linear_cross_entropy_"):
            return fused_loss_buffers(args["hidden"], args["weight"], args["chunk_size"],
                                      with_grads="with_grads" in name or "backward" in name)
        return 0

    return buffers


def prefetch_buffers(q, k, v, layout: str, mask: str, plan: str, world_size: int) -> int:
    """Bytes a ``prefetch_ring_backward`` node allocates and hands to its ring backward, an upper bound: the receive
    buffers of the first transfer's known-early tensors (one visiting shard of K and V, or of Q and the fp32 LSE),
    the ring backward's own first-step buffers allocated ahead of it (and a contiguous copy of K / V when they
    are not).  They live until the backward's first step: counted at a prefetch node where a graph holds one, and
    at every node between the prefetch's place and its ring backward by :func:`prefetch_ahead` (the predictions
    replay graphs from before the pass)."""
    from burstc.attention_ir import MaskSpec
    from burstc.ops.ring_attention import resolve_plan

    batch, heads_q, local_len, head_dim = q.shape
    elem = q.element_size()
    if resolve_plan(plan, q, k, world_size, layout, MaskSpec.decode(mask)) == "burst":
        return batch * heads_q * local_len * (head_dim * elem + ACC_BYTES) + (0 if q.is_contiguous() else q.nbytes)
    return 2 * k.nbytes + sum(0 if t.is_contiguous() else t.nbytes for t in (k, v))


def prefetch_ahead(world_size: int):
    """:func:`replay`'s ``ahead_buffers`` for a backward graph before the ``prefetch_ring_backward`` pass: each ring
    backward's :func:`prefetch_buffers` live at every node between the place that pass posts its prefetch (after
    the ring's inputs, the previous ring backward and the placeholders) and the ring backward itself (whose own
    buffers count the rest), in the replay's order.  Not on the hybrid (Ulysses) ring, which the pass skips."""
    from burstc.passes.graph_utils import normalized_kwargs
    from burstc.passes.prefetch_ring_backward import prefetch_inputs

    def ahead(order: list[fx.Node]) -> list[int]:
        held = [0] * len(order)
        position = {node: index for index, node in enumerate(order)}
        previous = max((position[n] for n in order if n.op == "placeholder"), default=-1)
        for index, node in enumerate(order):
            if node.op != "call_function" or str(node.target) != "burstc.ring_attention_backward.default":
                continue
            args = bound_args(node)
            if list(args["group_names"])[:1] != ["ulysses"]:
                # the prefetch reads what the forward saved, not grad_out (made just before the ring backward)
                reads = prefetch_inputs(normalized_kwargs(node) or {})
                earliest = max([previous] + [position[n] for n in reads if n in position])
                nbytes = prefetch_buffers(args["q"], args["k"], args["v"], args["layout"], args["mask"],
                                          args["plan"], world_size)
                for between in range(earliest + 1, index):
                    held[between] += nbytes
            previous = index
        return held

    return ahead


def pending_backward_buffers(q, k) -> int:
    """Bytes a split ring backward (``overlap_ring_backward``) holds from its start to its finish, an upper bound:
    its fp32 gradient accumulators (dq, dk, dv: the finish returns them in the inputs' dtype) and the fp32 buffers
    its last hop receives into (at most the travelling side's gradients: dq, or dk and dv)."""
    batch, heads_q, local_len, head_dim = q.shape
    q_elems, kv_elems = batch * heads_q * local_len * head_dim, batch * k.shape[1] * local_len * head_dim
    return ACC_BYTES * (q_elems + 2 * kv_elems + max(q_elems, 2 * kv_elems))


# --------------------------------------------------------------------------------------------------------------
# one training step

OPTIMIZER_STATES = {"adamw": 2, "adam": 2, "sgd": 0, "sgd_momentum": 1}
"""Tensors of a parameter's size an optimizer keeps per parameter (``exp_avg`` and ``exp_avg_sq`` for Adam)."""


@dataclasses.dataclass
class MemoryEstimate:
    """Predicted per-rank memory of one training step (forward + backward) of a compiled model, in bytes.

    ``parameters``, ``buffers`` and ``optimizer_state`` are resident before the step; ``step_peak`` is the
    most the step holds above them (what :func:`measure_peak` around ``loss = model(...); loss.backward()``
    measures, with the gradients set to None before it); ``peak = parameters + buffers + optimizer_state +
    step_peak``.  At the step's peak: ``saved_activations`` (values the forward keeps for the backward),
    ``gradients`` (parameter gradients made so far), ``op_buffers`` (inside the op running there) and
    ``temporaries`` (the rest).  ``saved_total``: everything the forwards save, the whole step's
    activations; ``saved_by_layer``: that by decoder layer (module path), ``""`` for what is outside layers."""

    parameters: int = 0
    buffers: int = 0
    optimizer_state: int = 0
    step_peak: int = 0
    peak_phase: str = ""
    peak_node: str = ""
    saved_activations: int = 0
    gradients: int = 0
    op_buffers: int = 0
    temporaries: int = 0
    saved_total: int = 0
    saved_by_layer: dict = dataclasses.field(default_factory=dict)
    backend: str = ""
    # Inductor graphs replayed in the order its scheduler ran their kernels (False: the FX graphs' order, as when
    # Inductor's cache served them and no scheduling ran)
    scheduled: bool = False

    @property
    def resident(self) -> int:
        return self.parameters + self.buffers + self.optimizer_state

    @property
    def peak(self) -> int:
        return self.resident + self.step_peak

    def breakdown(self) -> dict[str, int]:
        return {"parameters": self.parameters, "buffers": self.buffers, "optimizer_state": self.optimizer_state,
                "saved_activations": self.saved_activations, "gradients": self.gradients,
                "op_buffers": self.op_buffers, "temporaries": self.temporaries, "total": self.peak}

    def summary(self) -> str:
        from burstc.report import _fmt_bytes

        return (f"memory (predicted per rank, one training step): peak {_fmt_bytes(self.peak)} = resident "
                f"{_fmt_bytes(self.resident)} (parameters {_fmt_bytes(self.parameters)}"
                + (f", optimizer state {_fmt_bytes(self.optimizer_state)}" if self.optimizer_state else "")
                + f") + step {_fmt_bytes(self.step_peak)} at {self.peak_phase} `{self.peak_node}` (saved activations "
                f"{_fmt_bytes(self.saved_activations)}, gradients {_fmt_bytes(self.gradients)}, op buffers "
                f"{_fmt_bytes(self.op_buffers)}, temporaries {_fmt_bytes(self.temporaries)})"
                + (("; replayed in Inductor's kernel order and buffers" if self.scheduled else "; replayed in the FX graphs' order (Inductor's cache served "
                    "them: no schedule seen), which can hold less than Inductor's") if self.backend == "inductor"
                   else ""))


_LAYER = re.compile(r"^(?P<path>.*?\D)\.?(?:\[')?(?P<index>\d+)(?:'\])?$")


def _layer_of(node: fx.Node | None) -> str:
    """The outermost indexed module (``layers.3``) a node ran in, else ``""``."""
    from burstc.pass_context import _clean_fqn

    for path, _ in ((node.meta.get("nn_module_stack") or {}).values() if node is not None else ()):
        clean = _clean_fqn(path)
        parts = clean.split(".")
        for i, part in enumerate(parts):
            if part.isdigit():
                return ".".join(parts[:i + 1])
    return ""


def resident_bytes(captured: fx.GraphModule | None) -> tuple[int, int]:
    """(parameter bytes, buffer bytes) among the Dynamo graph's inputs, each tensor once."""
    from burstc.passes.graph_utils import placeholder_example, placeholder_kind

    sizes = {"parameter": 0, "buffer": 0}
    seen = set()
    for node in (captured.graph.nodes if captured is not None else ()):
        if node.op != "placeholder":
            continue
        kind, example = placeholder_kind(node), placeholder_example(node)
        if kind in sizes and isinstance(example, torch.Tensor) and id(example) not in seen:
            seen.add(id(example))
            sizes[kind] += example.numel() * example.element_size()
    return sizes["parameter"], sizes["buffer"]


def predict_graphs(records: list[tuple[fx.GraphModule, fx.GraphModule, int]], *, backend: str,
                   parameters: int = 0, buffers: int = 0, optimizer: str | None = None,
                   schedules: list[dict] | None = None, overlap: BackwardOverlap | None = None) -> MemoryEstimate:
    """The step of ``records``: (forward graph, backward graph, ring world size) per Dynamo graph, run
    forward in order and backward in reverse order; ``schedules``: per record, ``{"forward": ..., "backward":
    ...}`` the order Inductor ran each graph in (:func:`inductor_schedule`), where known.  ``overlap``: the
    backward graphs are AOTAutograd's, before the ``overlap_ring_backward`` and ``prefetch_ring_backward`` passes,
    which will run as this says (:func:`overlap_option`): they are replayed in the order the first will give them,
    with the buffers the second posts ahead of each ring backward (:func:`prefetch_ahead`)."""
    schedules = schedules or [{} for _ in records]
    if optimizer is not None and optimizer not in OPTIMIZER_STATES:
        raise ValueError(f"burstc.memory: optimizer must be one of {sorted(OPTIMIZER_STATES)} or None, "
                         f"got {optimizer!r}")
    estimate = MemoryEstimate(parameters=parameters, buffers=buffers, backend=backend,
                              optimizer_state=OPTIMIZER_STATES.get(optimizer, 0) * parameters,
                              scheduled=any(s.get("forward") or s.get("backward") for s in schedules))
    storages = _Storages()
    held: dict[tuple, int] = {}  # counted storages live between graphs: saved values, then gradients
    saved_keys: list[set] = []
    forward_returned: list[dict] = []
    phases = []
    for index, (forward, backward, world_size) in enumerate(records):
        result, returned = replay(forward, storages, f"f{index}", op_buffers=op_buffers(world_size),
                                  schedule=schedules[index].get("forward"))
        phases.append((f"forward of graph {index}", result, dict(held)))
        forward_returned.append(returned)
        keys = {k for ks in returned.values() for k in ks if k in storages.counted}
        saved_keys.append(keys)
        names = {n.name: n for n in forward.graph.nodes}
        for name, ks in returned.items():
            for k in ks:
                if k in storages.counted and k not in held:
                    estimate.saved_by_layer.setdefault(_layer_of(names.get(k[1])), 0)
                    estimate.saved_by_layer[_layer_of(names.get(k[1]))] += storages.bytes[k]
        held.update({k: storages.bytes[k] for k in keys})
    estimate.saved_total = sum(held.values())
    gradients: dict[tuple, int] = {}
    for index in reversed(range(len(records))):
        forward, backward, world_size = records[index]
        # the backward's inputs are the forward's outputs of the same names (AOTAutograd's saved values)
        inputs = {node.name: forward_returned[index][node.name] for node in backward.graph.nodes
                  if node.op == "placeholder" and node.name in forward_returned[index]}
        others = {k: b for k, b in held.items() if k not in saved_keys[index]}
        order = None
        if overlap is not None and overlap.split and world_size > 1 and not schedules[index].get("backward"):
            order = _overlap_order(backward, overlap)
        ahead = prefetch_ahead(world_size) if overlap is not None and overlap.prefetch and world_size > 1 else None
        result, outputs = replay(backward, storages, f"b{index}", inputs=inputs,
                                 inputs_freed=backend == "inductor", op_buffers=op_buffers(world_size),
                                 schedule=schedules[index].get("backward"), order=order, ahead_buffers=ahead)
        phases.append((f"backward of graph {index}", result, others))
        for key in saved_keys[index]:
            held.pop(key, None)
        for ks in outputs.values():
            for k in ks:
                if k in storages.counted:
                    gradients[k] = storages.bytes[k]
                    held[k] = storages.bytes[k]
    for phase, result, others in phases:
        step = result.peak_bytes + sum(others.values())
        if step > estimate.step_peak:
            live = {**others, **result.live_at_peak}
            saved = {k for ks in saved_keys for k in ks}
            estimate.step_peak, estimate.peak_phase, estimate.peak_node = step, phase, result.peak_node
            estimate.op_buffers = result.peak_op_buffers
            # a gradient the fused loss computes in the forward is saved until the backward returns it
            estimate.gradients = sum(b for k, b in live.items() if k in gradients)
            estimate.saved_activations = sum(b for k, b in live.items() if k in saved and k not in gradients)
            estimate.temporaries = step - estimate.op_buffers - estimate.saved_activations - estimate.gradients
    return estimate


def predict_step(report, optimizer: str | None = None) -> MemoryEstimate:
    """:class:`MemoryEstimate` of one training step of the model behind ``report`` (a :class:`burstc.report.Report`
    after a training call and its backward): every graph with a forward and a backward graph."""
    records = [g for g in report.graph_records if "forward" in g.graphs and "backward" in g.graphs]
    if not records:
        raise RuntimeError("burstc.memory: no graph with a backward yet; run one training step (forward and "
                           "backward) of the compiled model first")
    parameters = buffers = 0
    for g in records:
        p, b = resident_bytes(g.graphs.get("captured"))
        parameters, buffers = parameters + p, buffers + b
    graphs = [(g.graphs["forward"], g.graphs["backward"], g.sharding.world_size if g.sharding is not None else 1)
              for g in records]
    return predict_graphs(graphs, backend=report.config.backend, parameters=parameters, buffers=buffers,
                          optimizer=optimizer, schedules=[g.schedules for g in records],
                          overlap=overlap_option(report.config))


def explain_memory(*, model, report, mesh_shape, seq_len: int, batch: int, device) -> str:
    """The memory lines of ``burstc explain`` (:mod:`burstc.explain`): :func:`predict_step` with AdamW state,
    and the same with parameters, gradients and optimizer state sharded over every rank of the mesh (FSDP /
    ZeRO-3 over the sequence ranks too, as BurstEngine runs), the activations unchanged."""
    from burstc.report import _fmt_bytes

    estimate = predict_step(report, optimizer="adamw")
    ranks = 1
    for size in mesh_shape:
        ranks *= size
    # parameters, their gradients and AdamW's two moments, 1/ranks of each under FSDP; the step's own peak stays
    state = estimate.parameters + estimate.optimizer_state + estimate.gradients
    sharded = estimate.peak - state + state // max(ranks, 1)
    return ("memory per rank: " + estimate.summary().removeprefix("memory ")
            + f"\nmemory per rank with parameters, gradients and optimizer state sharded over all {ranks} ranks "
              f"(FSDP): about {_fmt_bytes(sharded)}")


# --------------------------------------------------------------------------------------------------------------
# memory_budget=: the checkpoint mode whose predicted peak fits

BUDGET_MODES = ("none", "selective", "layers")
"""The ``checkpoint=`` modes in the order of their recomputation cost (none recomputes nothing, selective a layer's
projections and MLP, layers the ring attention too)."""

BUDGET_KEEP_FRACTIONS = (0.75, 0.5, 0.25)
PLANNED_MODES = ("none", "selective") + tuple(f"selective:{f}" for f in BUDGET_KEEP_FRACTIONS) + ("layers",)
"""What ``memory_budget=`` tries, cheapest recomputation first, and takes the first that fits: ``"selective:f"`` is
``checkpoint="selective", checkpoint_keep=f`` (the ring recomputed for the rows not kept, :mod:`burstc.kept_rows`)."""


def mode_options(mode: str) -> str:
    """A planned mode as the options that give it: ``checkpoint='selective', checkpoint_keep=0.5``."""
    base, _, keep = mode.partition(":")
    return f"checkpoint={base!r}" + (f", checkpoint_keep={keep}" if keep else "")


@dataclasses.dataclass
class MemoryPlan:
    """What ``memory_budget=`` decided for one graph: the mode that runs, each mode's predicted peak per rank
    (:attr:`MemoryEstimate.peak`), and whether the chosen one fits."""

    graph_id: int
    budget: int
    mode: str  # one of PLANNED_MODES, or "selective:f" with a refined f
    predicted: dict
    fits: bool
    kept: tuple = ()  # the chosen mode's burstc.kept_rows.KeptRows (a "selective:f" mode)

    def summary(self) -> str:
        from burstc.report import _fmt_bytes

        modes = ", ".join(f"{m} {_fmt_bytes(b)}" for m, b in self.predicted.items())
        if self.fits:
            chosen = _fmt_bytes(self.predicted[self.mode])
            return (f"graph {self.graph_id}: memory_budget {_fmt_bytes(self.budget)} per rank: "
                    f"{mode_options(self.mode)} chosen, predicted peak {chosen} (predicted: {modes})")
        return (f"graph {self.graph_id}: memory_budget {_fmt_bytes(self.budget)} per rank: no checkpoint mode fits "
                f"(predicted: {modes}); running {mode_options(self.mode)}, the least memory")


def _mode_tags(joint: fx.GraphModule, mode: str) -> fx.GraphModule:
    """A copy of the joint graph tagged for ``mode``, from the tags of the ``"selective"`` planning (burstc's
    layers and the user's regions recompute all but the ring attention): ``"layers"`` recomputes the ring
    too, ``"none"`` drops burstc's regions (the user's recompute their ring, as without burstc's option)."""
    from torch.utils.checkpoint import CheckpointPolicy

    from burstc.passes.checkpoint_layers import BURSTC_LAYER
    from burstc.report import snapshot_graph

    copy = snapshot_graph(joint)
    for node in copy.graph.nodes:
        node.meta = dict(node.meta)  # snapshot_graph shares meta: retag this copy only
        if "recompute" not in node.meta:
            continue
        ours = BURSTC_LAYER in (node.meta.get("custom") or {})
        if mode == "none" and ours:
            node.meta.pop("recompute")
            node.meta.pop("ac_graph_id", None)
        elif mode != "selective" and node.target is torch.ops.burstc.ring_attention_forward.default:
            node.meta["recompute"] = CheckpointPolicy.PREFER_RECOMPUTE
    return copy


# bisection steps between the largest grid fraction that fits and the next larger one that does not: the kept
# fraction memory_budget picks is then within (grid step) / 2**3 = 1/32 of the largest that fits
KEEP_REFINE_STEPS = 3


@dataclasses.dataclass(frozen=True)
class BackwardOverlap:
    """How the mesh-only backward passes will rewrite the backward graphs: ``split``: ``overlap_ring_backward`` runs,
    with ``overlap_memory_bytes`` = ``memory_bytes`` (None: per call, what it holds through its hop); ``prefetch``:
    ``prefetch_ring_backward`` runs."""

    memory_bytes: int | None = None
    split: bool = True
    prefetch: bool = True


def overlap_option(config) -> BackwardOverlap | None:
    """:func:`predict_graphs`'s ``overlap`` for a compile with ``config``: None when neither the
    ``overlap_ring_backward`` nor the ``prefetch_ring_backward`` pass will run."""
    split = "overlap_ring_backward" not in config.disable_passes
    prefetch = config.prefetch_ring_backward and "prefetch_ring_backward" not in config.disable_passes
    return BackwardOverlap(config.overlap_memory_bytes, split, prefetch) if split or prefetch else None


def _overlap_order(backward: fx.GraphModule, overlap: BackwardOverlap) -> list[fx.Node]:
    """``backward``'s nodes in the order the ``overlap_ring_backward`` pass will run them."""
    from burstc.passes.overlap_ring_backward import moved_order, overlap_cap, plan_overlap

    return moved_order(backward.graph, plan_overlap(backward.graph, overlap_cap(overlap.memory_bytes)))


def partition_within_budget(partition, joint: fx.GraphModule, joint_inputs, partition_kwargs: dict, *, budget: int,
                            backend: str, world_size: int, parameters: int, buffers: int, graph_id: int,
                            overlap: BackwardOverlap | None = None):
    """Partition ``joint`` (AOTAutograd's joint graph, tagged for ``"selective"``) once per mode of
    :data:`PLANNED_MODES` with ``partition`` (torch's min-cut partitioner), predict each mode's peak, and
    return the first mode's (forward, backward) that fits, else the least memory's; and the
    :class:`MemoryPlan`.  When a kept fraction fits and the next larger one tried did not, the fraction is
    refined by bisection between them (:data:`KEEP_REFINE_STEPS`): the most rows kept that fit."""
    from burstc.kept_rows import keep_attention_rows, retag_for_recompute

    partitions, predicted, kept = {}, {}, {}

    def fits(mode) -> bool | None:
        """Partition and predict ``mode``; None when it does not apply (no attention can keep part of its rows)."""
        base, _, keep = mode.partition(":")
        tagged = _mode_tags(joint, base)
        if keep and not retag_for_recompute(tagged):
            return None
        partitions[mode] = partition(tagged, joint_inputs, **partition_kwargs)
        if keep:
            kept[mode] = tuple(keep_attention_rows(*partitions[mode], float(keep), partition_kwargs["num_fwd_outputs"],
                                                   world_size))
        estimate = predict_graphs([(*partitions[mode], world_size)], backend=backend, parameters=parameters,
                                  buffers=buffers, overlap=overlap)
        predicted[mode] = estimate.peak
        return estimate.peak <= budget

    too_many_kept = None  # the largest kept fraction tried that did not fit ("selective": all rows, 1.0)
    for mode in PLANNED_MODES:
        fit = fits(mode)
        base, _, keep = mode.partition(":")
        if fit and keep and too_many_kept is not None:
            fitting, over = float(keep), too_many_kept
            for _ in range(KEEP_REFINE_STEPS):
                middle = round((fitting + over) / 2, 6)
                if fits(f"selective:{middle:g}"):
                    fitting = middle
                else:
                    over = middle
            mode = f"selective:{fitting:g}"
        if fit:
            return partitions[mode], MemoryPlan(graph_id, budget, mode, predicted, fits=True, kept=kept.get(mode, ()))
        if fit is False and base == "selective":
            too_many_kept = float(keep) if keep else 1.0
    mode = min(predicted, key=lambda m: (predicted[m], PLANNED_MODES.index(m)))
    return partitions[mode], MemoryPlan(graph_id, budget, mode, predicted, fits=False, kept=kept.get(mode, ()))
