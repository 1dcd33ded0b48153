"""``burstc explain MODULE:FACTORY --mesh 8x8 --seq-len 1M``: what burstc would do to a model on a cluster, from
one process, without the cluster.

The model is built on the meta device (a 7B model allocates nothing), its parameters become fake tensors
(:class:`torch._subclasses.fake_tensor.FakeTensorMode`: shapes and dtypes, no storage), and a fake process
group of the mesh's size stands in for the ranks (torch's ``"fake"`` backend: this process is rank 0 and every
collective returns at once).  ``burstc.compile`` then compiles it as it would on rank 0 (``aot_eager``: the
passes, AOTAutograd's forward and backward graphs, no Inductor codegen) at the first call, and the call and
its backward run on the fake tensors: every op, the ring ops and collectives included, dispatches to its fake
kernel, so nothing executes on data.  What comes back is the report: the rewrites, the ring and backward plan
of every attention with the cost model's reasons, the bytes per rank per link class, a predicted step time on a
named device (:data:`burstc.cost_model.DEVICES`), and every graph as readable Python.

Predicted memory per rank comes from :mod:`burstc.memory` when it is installed (see :func:`_memory_section`).
"""
from __future__ import annotations

import argparse
import dataclasses
import importlib
import inspect
import math
import re
import sys
import time
from pathlib import Path

import torch

LINK_CLASSES = ("intra", "inter")


def parse_mesh(text: str) -> tuple[int, ...]:
    """``"8x8"`` -> ``(8, 8)`` (nodes x ranks per node); ``"64"`` or ``"1x64"`` -> ``(64,)`` (one flat ring)."""
    parts = re.split(r"[x×*,]", str(text).strip().lower())
    try:
        dims = tuple(int(p) for p in parts)
    except ValueError:
        raise ValueError(f"mesh {text!r}: expected N or NxM (nodes x ranks per node), e.g. 8x8") from None
    if not 1 <= len(dims) <= 2 or min(dims) < 1:
        raise ValueError(f"mesh {text!r}: expected N or NxM with positive sizes, e.g. 8x8")
    dims = tuple(d for d in dims if d > 1) or (1,)
    return dims if len(dims) == 2 else (math.prod(dims),)


def parse_length(text) -> int:
    """``"1M"`` -> 1048576, ``"64K"`` / ``"64k"`` -> 65536, ``"4096"`` -> 4096 (binary K/M/G)."""
    match = re.fullmatch(r"\s*(\d+)\s*([kKmMgG]?)\s*", str(text))
    if not match:
        raise ValueError(f"sequence length {text!r}: expected an integer with an optional K/M/G suffix (1M = 2**20)")
    return int(match.group(1)) * 1024 ** " kmg".index(match.group(2).lower() or " ")


def load_factory(spec):
    """``"module:attr"`` -> the callable; a callable is returned as is."""
    if callable(spec):
        return spec
    module_name, _, attr = str(spec).partition(":")
    if not module_name or not attr:
        raise ValueError(f"factory {spec!r}: expected MODULE:FACTORY, e.g. burstc.testing.zoo.hf:llama_7b")
    factory = getattr(importlib.import_module(module_name), attr, None)
    if not callable(factory):
        raise ValueError(f"factory {spec!r}: {module_name} has no callable {attr!r}")
    return factory


@dataclasses.dataclass
class AttentionExplained:
    """One attention: its module, ring (``double 8x8``, ``ulysses_ring 8x8``, ``flat``), backward plan, why, the
    busiest rank's bytes per call ``{"forward"|"backward": {link class: bytes}}`` and the cost model's seconds
    per ring (2-D meshes)."""

    module: str
    ring: str
    plan: str
    mask: str
    reason: str
    bytes_by_link: dict
    predicted_seconds: dict
    seconds: float
    head_groups: int = 1  # the head groups each call runs as (burstc.ops.head_groups)


@dataclasses.dataclass
class Explanation:
    """What :func:`explain` returns; ``str()`` is the printed report."""

    factory: str
    mesh_shape: tuple[int, ...]
    seq_len: int
    batch: int
    device: object  # burstc.cost_model.Device
    report: object  # burstc.report.Report
    attentions: list[AttentionExplained]
    parameters: int
    parameter_bytes: int
    step_seconds: dict[str, float]
    memory: str
    graph_files: list[Path]
    seconds_taken: float

    @property
    def world_size(self) -> int:
        return math.prod(self.mesh_shape)

    def bytes_per_rank(self) -> dict[str, int]:
        """Ring bytes the busiest rank sends per training step (every attention, forward + backward), per link class."""
        total: dict[str, int] = {}
        for attention in self.attentions:
            for links in attention.bytes_by_link.values():
                for link, nbytes in links.items():
                    total[link] = total.get(link, 0) + nbytes
        return total

    def __str__(self) -> str:
        from burstc.report import _fmt_bytes, _table

        mesh = "x".join(map(str, self.mesh_shape))
        layout = ("(inter, intra): nodes x ranks per node" if len(self.mesh_shape) == 2
                  else "(one flat ring; its links costed as inter-node)")
        lines = [f"burstc explain {self.factory}: {self.parameters / 1e9:.2f}B parameters "
                 f"({_fmt_bytes(self.parameter_bytes)}), batch {self.batch} x {self.seq_len:,} tokens "
                 f"on a {mesh} mesh {layout} = {self.world_size} ranks, {self.seq_len // self.world_size:,} tokens "
                 f"per rank", f"device {self.device.source}",
                 "", *[self.report.summary(g.graph_id) for g in self.report.graph_records], ""]
        rows = [[_modules([g.module for g in group]), a.ring + (f" ({a.head_groups} head groups)" if a.head_groups > 1
                                                                 else ""), a.plan, a.mask,
                 ", ".join(f"{kind} {' + '.join(f'{link} {_fmt_bytes(n)}' for link, n in links.items())}"
                           for kind, links in a.bytes_by_link.items()),
                 f"{a.seconds * 1e3:.1f} ms", a.reason]
                for _, a, group in _grouped(self.attentions, lambda a: repr(dataclasses.replace(a, module="")))]
        lines.append(_table("attention plans (bytes: what the busiest rank sends per call; predicted: forward + "
                            "backward)", ["modules", "ring", "backward", "mask", "bytes", "predicted", "why"], rows))
        lines.append("")
        per_step = self.bytes_per_rank()
        lines.append("ring bytes per rank per step (all attentions, forward + backward): "
                     + (", ".join(f"{link} {_fmt_bytes(n)}" for link, n in per_step.items()) or "none"))
        lines.append(f"predicted step time on {self.device.name} (forward + backward, not overlapped with each other):")
        for name, seconds in self.step_seconds.items():
            lines.append(f"  {name:<58} {seconds:10.3f} s")
        if any(g.sharding is None for g in self.report.graph_records):
            lines.append("  (a graph runs replicated: its GEMMs are counted for every token on every rank, its "
                         "attention is not costed)")
        lines.append(self.memory)
        other = [r for r in self.report.rewrites if r.kind != "attention"]
        lines.append("")
        lines.append(_table("other rewrites", ["kind", "modules", "what"], [
            [kind, _modules([r.module_path for r in group]), what]
            for (kind, what), _, group in _grouped(other, lambda r: (r.kind, _short_details(r)))]))
        lines.append(_table("skipped (not rewritten, and why)", ["kind", "node", "code", "reason"],
                            [[s.kind, s.node, s.code, s.reason] for s in self.report.skipped]))
        if self.graph_files:
            lines.append(f"graphs: {len(self.graph_files)} files under {self.graph_files[0].parent}")
        lines.append(f"(explained in {self.seconds_taken:.1f} s on a fake process group; nothing ran on data)")
        return "\n".join(lines)


def _grouped(items, key):
    """``[(key, first item, [items with that key])]`` in first-seen order (the 32 identical layers of a model: one row)."""
    groups: dict = {}
    for item in items:
        groups.setdefault(key(item), []).append(item)
    return [(k, group[0], group) for k, group in groups.items()]


def _modules(paths) -> str:
    """``["model.layers.0.self_attn", ..., "model.layers.31.self_attn"]`` -> ``model.layers.{0..31}.self_attn (x32)``."""
    paths = [p for p in paths if p] or [""]
    if len(paths) == 1:
        return paths[0]
    parts = [re.match(r"^(.*?)(\d+)(\D*)$", p) for p in paths]
    if all(parts) and len({(m.group(1), m.group(3)) for m in parts}) == 1:
        numbers = [int(m.group(2)) for m in parts]
        return f"{parts[0].group(1)}{{{min(numbers)}..{max(numbers)}}}{parts[0].group(3)} (x{len(paths)})"
    return f"{paths[0]} ... {paths[-1]} (x{len(paths)})"


def _short_details(record) -> str:
    from burstc.report import _fmt_details

    keep = ("tokens", "vocab", "chunk_size", "mask", "notes", "seq_len", "local_tokens", "attention_ops", "losses")
    return _fmt_details({k: v for k, v in record.details.items() if k in keep})


def _fake_parameters(model: torch.nn.Module, fake_mode) -> None:
    """Every meta parameter and buffer of ``model`` -> a fake CPU tensor of its shape and dtype (no storage)."""
    with fake_mode:
        for module in model.modules():
            for name, param in list(module._parameters.items()):
                if param is not None:
                    module._parameters[name] = torch.nn.Parameter(
                        torch.empty(param.shape, dtype=param.dtype), requires_grad=param.requires_grad)
            for name, buffer in list(module._buffers.items()):
                if buffer is not None:
                    module._buffers[name] = torch.empty(buffer.shape, dtype=buffer.dtype)


def _model_call(model, ids):
    """The call ``burstc explain`` makes: HF-style ``(input_ids=, labels=, use_cache=False)`` when the forward
    takes them, else ``model(ids, ids)`` (tokens, targets) when it needs two arguments, else ``model(ids)``; returns
    the scalar to differentiate."""
    params = inspect.signature(getattr(model, "_orig_mod", model).forward).parameters
    if "input_ids" in params and "labels" in params:
        kwargs = {"input_ids": ids, "labels": ids}
        if "use_cache" in params:
            kwargs["use_cache"] = False
        out = model(**kwargs)
        return out.loss if hasattr(out, "loss") else out[0]
    required = [p for p in params.values() if p.default is p.empty and p.kind in (p.POSITIONAL_ONLY,
                                                                               p.POSITIONAL_OR_KEYWORD)]
    out = model(ids, ids) if len(required) >= 2 else model(ids)  # (tokens, targets) or (tokens)
    out = out[0] if isinstance(out, (tuple, list)) else out
    return out if out.dim() == 0 else out.float().mean()


def _ring_seconds(details: dict, ring: str) -> float | None:
    seconds = details.get("predicted_seconds") or {}
    key = "ulysses" if ring.startswith("ulysses") else ring.split()[0]
    return seconds.get(key)


@dataclasses.dataclass(frozen=True)
class _RingCall:
    """One ring op of the rewritten graph: what the planner and the cost model take."""

    layout: str
    mask: object  # burstc.attention_ir.MaskSpec
    plan: str
    seq_len: int
    batch: int
    heads_q: int
    heads_kv: int
    head_dim: int
    dtype: torch.dtype

    @classmethod
    def of(cls, node, world_size: int) -> "_RingCall":
        from burstc.attention_ir import MaskSpec

        q, k = (arg.meta["example_value"] for arg in node.args[:2])
        B, Hq, local_len, D = q.shape
        return cls(node.args[4], MaskSpec.decode(node.args[5]), node.args[7], local_len * world_size, B, Hq,
                   k.shape[1], D, q.dtype)

    def flat_seconds(self, mesh_shape, machine) -> float:
        """Forward + backward on a flat ring over a 1-D mesh, whose links are all taken as the slower class."""
        from burstc.cost_model import predicted_ring_cost

        size = math.prod(mesh_shape)
        return predicted_ring_cost("flat", self.layout, self.mask, self.seq_len, size, 1, self.batch, self.heads_q,
                                   self.heads_kv, self.head_dim, self.dtype, self.plan, machine).total

    def flat_bytes_by_link(self, mesh_shape) -> dict:
        """The busiest rank's bytes per link class of a flat ring over the flattened ``nodes x per_node`` mesh."""
        from burstc.planner import predicted_transfers

        found = predicted_transfers(self.layout, self.mask, self.seq_len, math.prod(mesh_shape), self.batch,
                                    self.heads_q, self.heads_kv, self.head_dim, self.dtype, per_node=mesh_shape[-1])
        ops = {"forward": "forward", "backward": self.plan}
        return {kind: {link: max(links.get(link, 0) for links in found[op].sent_by_link) for link in LINK_CLASSES}
                for kind, op in ops.items()}


def _ring_calls(report, world_size: int) -> dict:
    """``{(graph id, name of the rewrite's output node): _RingCall}`` from the rewritten graphs."""
    calls = {}
    for record in report.graph_records:
        gm = record.graphs.get("rewritten")
        for node in gm.graph.nodes if gm is not None else ():
            if node.op == "call_function" and node.target is torch.ops.burstc.ring_attention_forward.default:
                for user in node.users:
                    calls[(record.graph_id, user.name)] = _RingCall.of(node, world_size)
    return calls


def _attentions(report, mesh_shape, machine) -> list[AttentionExplained]:
    calls = _ring_calls(report, math.prod(mesh_shape))
    found = []
    for r in report.rewrites_of("attention"):
        d = r.details
        ring = d.get("ring", "flat")
        call = calls.get((r.graph_id, r.node))
        by_link = d.get("predicted_bytes_by_link")
        if by_link is None and call is not None and len(mesh_shape) == 2:
            by_link = call.flat_bytes_by_link(mesh_shape)
        if by_link is None:  # a 1-D mesh: one class of link
            by_link = {kind: {"ring": n} for kind, n in d["predicted_bytes"].items()}
        seconds = _ring_seconds(d, ring)
        if seconds is None:
            seconds = call.flat_seconds(mesh_shape, machine) if call is not None else float("nan")
        found.append(AttentionExplained(r.module_path, ring, d["plan"], d.get("mask", ""), _reason(d, ring),
                                        by_link, dict(d.get("predicted_seconds") or {}), seconds,
                                        int(d.get("head_groups", 1))))
    return found


def _reason(details: dict, ring: str) -> str:
    predicted = details.get("predicted_seconds")
    if predicted:
        ranked = " < ".join(f"{name} {seconds * 1e3:.4g} ms" for name, seconds in sorted(predicted.items(),
                                                                                           key=lambda kv: kv[1]))
        why = f"cost model, forward + backward: {ranked}"
        fastest = min(predicted.values())
        if ring in predicted and predicted[ring] > fastest:
            from burstc.cost_model import NEAR_TIE

            why += (f"; {ring} within {NEAR_TIE:.0%} of the fastest, a tie: ties go to the ring that sends fewer "
                    "bytes between nodes")
    else:
        why = "one sequence dim: the flat ring"
    if details.get("ring_note"):
        why += f"; {details['ring_note']}"
    plan = details["plan"]
    if details.get("planner_choice") == plan:
        why += f"; backward {plan}: its busiest rank sends fewer bytes ({details['heads']} heads)"
    else:
        why += f"; backward {plan}: as asked (attention_plan=)"
    return why


def _step_seconds(attentions, gemm_parameters: int, parameter_bytes: int, tokens_per_rank: int, mesh_shape, device
                  ) -> dict[str, float]:
    """The step's parts on ``device``: ring attention (the cost model, every attention), the GEMMs (6 FLOPs per
    non-embedding parameter and token at peak: a lower bound) and the gradient all-reduce over the sequence ranks (a ring
    all-reduce on the slower link, not overlapped: an upper bound; ``parameter_bytes`` 0 when burstc does not
    reduce them: a replicated graph, ``reduce_grads=False``)."""
    size = math.prod(mesh_shape)
    link = "inter"  # the ring over all ranks crosses nodes (a 1-D mesh's nodes are unknown: the slower class)
    parts = {
        f"ring attention x{len(attentions)} (cost model)": sum(a.seconds for a in attentions),
        "GEMMs: 6 x parameters x tokens per rank at peak FLOP/s":
            6 * gemm_parameters * tokens_per_rank / device.peak_flops,
        f"gradient all-reduce over {size} ranks ({link} links)":
            device.machine.seconds(link, 2 * (size - 1) * parameter_bytes // size) if size > 1 else 0.0,
    }
    parts["total"] = sum(parts.values())
    return parts


def _memory_section(model, report, mesh_shape, seq_len: int, batch: int, device) -> str:
    """Predicted memory per rank from :mod:`burstc.memory` (``burstc.memory.explain_memory(model=, report=,
    mesh_shape=, seq_len=, batch=, device=) -> str``) when it is installed; until then a note."""
    try:
        memory = importlib.import_module("burstc.memory")
    except ImportError:
        return "memory per rank: (not available: burstc.memory is not installed)"
    predict = getattr(memory, "explain_memory", None)
    if predict is None:
        return "memory per rank: (not available: burstc.memory has no explain_memory())"
    return predict(model=model, report=report, mesh_shape=mesh_shape, seq_len=seq_len, batch=batch, device=device)


def _write_graphs(report, out: Path) -> list[Path]:
    """Every graph of the report (every stage and pass of every Dynamo graph) as readable Python under ``out``."""
    out.mkdir(parents=True, exist_ok=True)
    written = []
    for record in report.graph_records:
        for index, (stage, gm) in enumerate(record.graphs.items()):
            path = out / f"graph{record.graph_id}_{index:02d}_{stage}.py"
            path.write_text(f"# burstc explain: graph {record.graph_id}, after {stage}\n"
                            + gm.print_readable(print_output=False, include_stride=True, include_device=True))
            written.append(path)
    return written


def explain(factory, mesh="8x8", seq_len=2**20, *, device: str = "H100", batch: int = 1, out=None,
            **compile_options) -> Explanation:
    """Compile ``factory()``'s model (``"module:attr"`` or a callable, built under ``torch.device("meta")``) as rank 0
    of a ``mesh`` (``"8x8"``, ``(8, 8)``, ``64``) would for ``batch x seq_len`` tokens, on a fake process group and
    fake tensors; return the :class:`Explanation`.  ``out``: a folder for the graphs as Python.
    ``compile_options``: burstc.compile's (``ring=``, ``layout=``, ``attention_plan=``, ...).  Needs a process with
    no process group; leaves none, and resets Dynamo's caches (``torch._dynamo.reset()``) when done, so that
    explaining many models of one class never reaches Dynamo's recompile limit."""
    import torch.distributed as dist
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.distributed.device_mesh import init_device_mesh
    from torch.testing._internal.distributed.fake_pg import FakeStore

    import burstc
    from burstc.cost_model import device as device_named

    started = time.perf_counter()
    mesh_shape = parse_mesh("x".join(map(str, mesh))) if isinstance(mesh, (tuple, list)) else parse_mesh(str(mesh))
    seq_len = parse_length(seq_len)
    spec = device_named(device)
    size = math.prod(mesh_shape)
    if seq_len % size:
        raise ValueError(f"seq_len {seq_len} must be a multiple of the mesh's {size} ranks")
    if dist.is_initialized():
        raise RuntimeError("burstc explain runs its own fake process group: call it where none is initialized")
    build = load_factory(factory)
    with torch.device("meta"):
        model = build()
    fake_mode = FakeTensorMode(allow_non_fake_inputs=True)
    _fake_parameters(model, fake_mode)
    parameters = sum(p.numel() for p in model.parameters())
    parameter_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    # embeddings are lookups, not GEMMs (an untied LM head is a GEMM: its weight is not an embedding's)
    embedded = {id(p) for m in model.modules() if isinstance(m, torch.nn.Embedding) for p in m.parameters()}
    gemm_parameters = sum(p.numel() for p in model.parameters() if id(p) not in embedded)
    with fake_mode:
        ids = torch.zeros((batch, seq_len), dtype=torch.long)
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=size)
    try:
        names = ("inter", "intra") if len(mesh_shape) == 2 else ("seq",)
        device_mesh = init_device_mesh("cpu", mesh_shape, mesh_dim_names=names)
        options = {"backend": "aot_eager", "check_inputs": False, "sync_module_states": False,
                   "link_bandwidth": dict(spec.machine.bandwidth), "compute_flops": spec.machine.attention_flops,
                   **compile_options}
        compiled = burstc.compile(model, device_mesh, **options)
        loss = _model_call(compiled, ids)
        if loss.requires_grad:
            loss.backward()  # fake: records the backward graph (aot_eager compiles it at the first backward)
        report = burstc.report(compiled)
    finally:
        torch._dynamo.reset()  # the compiled frames hold the fake process group's names
        dist.destroy_process_group()
    attentions = _attentions(report, mesh_shape, spec.machine)
    # a graph the shard pass refused runs replicated: every rank computes every token
    sharded = bool(report.graph_records) and all(g.sharding is not None for g in report.graph_records)
    tokens_per_rank = batch * seq_len // (size if sharded else 1)
    reduces_grads = sharded and compile_options.get("reduce_grads", True)
    steps = _step_seconds(attentions, gemm_parameters, parameter_bytes if reduces_grads else 0, tokens_per_rank,
                          mesh_shape, spec)
    memory = _memory_section(model, report, mesh_shape, seq_len, batch, spec)
    graph_files = _write_graphs(report, Path(out)) if out is not None else []
    name = factory if isinstance(factory, str) else getattr(factory, "__qualname__", repr(factory))
    return Explanation(name, mesh_shape, seq_len, batch, spec, report, attentions, parameters, parameter_bytes, steps,
                       memory, graph_files, time.perf_counter() - started)


def _parser() -> argparse.ArgumentParser:
    from burstc.cost_model import DEVICES

    parser = argparse.ArgumentParser(prog="burstc explain", description=(
        "Compile a model as rank 0 of a cluster would, on the meta device and a fake process group (no ranks, no "
        "data), and print burstc's plan: rewrites, the ring and backward plan of every attention and why, bytes "
        "per rank per link class, predicted step time on a named device; --out writes every graph as Python."))
    parser.add_argument("factory", help="MODULE:FACTORY, a callable returning the model, e.g. "
                                        "burstc.testing.zoo.hf:llama_7b")
    parser.add_argument("--mesh", default="8x8", help="NxM (nodes x GPUs per node: a 2-D mesh) or N (one flat ring)")
    parser.add_argument("--seq-len", default="1M", help="tokens per sequence; K/M suffixes are binary (1M = 2**20)")
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--device", default="H100", type=str.upper, choices=list(DEVICES))
    parser.add_argument("--ring", choices=["auto", "flat", "double", "ulysses"], default="auto")
    parser.add_argument("--layout", choices=["auto", "contiguous", "zigzag", "striped"], default="auto")
    parser.add_argument("--out", default=None, help="folder for the graphs as readable Python")
    return parser


def main(argv=None) -> int:
    parser = _parser()
    args = parser.parse_args(argv)
    try:
        seq_len = parse_length(args.seq_len)
        mesh = parse_mesh(args.mesh)
    except ValueError as error:
        parser.error(str(error))
    print(explain(args.factory, mesh, seq_len, device=args.device, batch=args.batch, out=args.out, ring=args.ring,
                  layout=args.layout))
    return 0


if __name__ == "__main__":
    sys.exit(main())
