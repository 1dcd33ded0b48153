"""``burstc.compile`` and ``burstc.report``."""
from __future__ import annotations

import dataclasses
import os

import torch

from burstc.backend import BurstBackend
from burstc.config import BurstConfig
from burstc.errors import MeshError, check_rank_in_mesh, describe_mesh
from burstc.guards import note_fsdp_submodules
from burstc.report import Report

_REPORT_ATTR = "_burstc_report"


@dataclasses.dataclass(frozen=True)
class SequenceMesh:
    """The part of the user's mesh that shards the sequence: ``flat`` (a 1-D DeviceMesh over the sequence dims,
    node-major: shards, gathers, checks, broadcasts and the flat ring run over it) and, on two sequence dims of
    at least 2 ranks each, their process-group names ``(inter, intra)`` for the two-level plans (else ``()``)."""

    flat: object
    ring_groups: tuple[str, ...]

    @property
    def size(self) -> int:
        return self.flat.size()


def sequence_mesh(mesh, config: BurstConfig) -> SequenceMesh | None:
    """``mesh`` (None, or a DeviceMesh of any dims) -> its :class:`SequenceMesh` (None: one device)."""
    if mesh is None:
        return None
    import torch.distributed as dist
    from torch.distributed.device_mesh import DeviceMesh

    if not isinstance(mesh, DeviceMesh):
        raise TypeError(f"mesh must be a torch.distributed DeviceMesh or None, got {type(mesh).__name__}")
    if mesh.size() == 1:
        return None
    if not dist.is_initialized():
        raise MeshError(f"burstc.compile: the process group of {describe_mesh(mesh)} is not initialized; call "
                        "dist.init_process_group (torchrun does it for you) before building the mesh")
    if mesh.size() > dist.get_world_size():
        raise MeshError(f"burstc.compile: {describe_mesh(mesh)} is larger than the world of "
                        f"{dist.get_world_size()} ranks; build it over at most the world's ranks")
    check_rank_in_mesh(mesh)
    names = tuple(mesh.mesh_dim_names or ())
    dims = config.seq_dims
    if dims is None:
        dims = names or tuple(range(mesh.ndim))
    else:
        unknown = [d for d in dims if d not in names]
        if unknown:
            raise ValueError(f"burstc.compile: seq_dims {list(dims)} name dims {unknown} that {describe_mesh(mesh)} "
                             f"does not have; its dims are {list(names) or 'unnamed'} (name them with "
                             "init_device_mesh(..., mesh_dim_names=...))")
    sub = mesh if len(dims) == mesh.ndim else mesh[dims]  # a subset of dims is named (checked above)
    flat = sub if sub.ndim == 1 else sub._flatten()
    shape = tuple(sub.shape)
    double = len(shape) == 2 and min(shape) >= 2
    if config.ring in ("double", "ulysses") and not double:
        raise ValueError(f"burstc.compile: ring={config.ring!r} needs two sequence dims of at least 2 ranks each (nodes x "
                         f"ranks per node), got sequence dims of sizes {list(shape)}; use ring='flat' or 'auto'")
    groups = (sub.get_group(0).group_name, sub.get_group(1).group_name) if double and config.ring != "flat" else ()
    return SequenceMesh(flat, groups) if flat.size() > 1 else None


@torch.no_grad()
def broadcast_module_states(model: torch.nn.Module, mesh) -> None:
    """Parameters and buffers (each tied tensor once) from the mesh's first rank to the others."""
    import torch.distributed as dist

    group = mesh.get_group()
    seen = set()
    for tensor in [*model.parameters(), *model.buffers()]:
        # the module's own tensor objects stay alive, so their ids are stable (a DTensor's to_local() is a
        # fresh object each time: its id could be reused by a later one)
        if id(tensor) in seen:
            continue
        seen.add(id(tensor))
        local = tensor.to_local() if hasattr(tensor, "to_local") else tensor  # a DTensor: its local shard
        if local.numel() == 0:
            continue
        if local.is_contiguous():
            dist.broadcast(local.data, group_src=0, group=group)
        else:  # collectives take contiguous tensors only
            staged = local.detach().contiguous()
            dist.broadcast(staged, group_src=0, group=group)
            local.data.copy_(staged)


def compile(model, mesh=None, **options):
    """Compile an unmodified causal LM (or any module / function) with burstc's passes.

    ``mesh=None`` (or a DeviceMesh of size 1) means one device.  Options are keyword-only and
    validated (see :class:`burstc.config.BurstConfig`); an unknown option or a bad value is a
    ``ValueError`` that names it.  Returns what ``torch.compile`` returns (an ``OptimizedModule`` for a module); call it like the original.
    """
    config = BurstConfig.from_options(options)
    seq = sequence_mesh(mesh, config)
    world_size = seq.size if seq is not None else 1
    mesh = seq.flat if seq is not None else None
    if world_size > 1:
        from burstc.ops.ring_comm import bound_reductions, set_wait_timeout

        for name in {mesh.get_group().group_name, *seq.ring_groups}:
            set_wait_timeout(name, config.timeout)
        bound_reductions(mesh.get_group(), config.timeout)
    if world_size > 1 and config.sync_module_states and isinstance(model, torch.nn.Module):
        broadcast_module_states(model, mesh)
    report = Report(config, world_size=world_size)
    if world_size > 1:
        note_fsdp_submodules(report, model)
    backend = BurstBackend(config, report, mesh=mesh, world_size=world_size,
                           ring_groups=seq.ring_groups if seq is not None else ())
    # torch._dynamo.optimize is what torch.compile calls; torch.compile would wrap the backend in an object
    # that hides its backend_ctx_ctor, the context Dynamo enters around tracing (see BurstBackend)
    compiled = torch._dynamo.optimize(backend, nopython=config.fullgraph, dynamic=config.dynamic)(model)
    trace_dir = config.trace or os.environ.get("BURSTC_TRACE") or None
    if trace_dir is not None:
        from burstc.timeline import trace_calls

        compiled = trace_calls(compiled, trace_dir, report)
    # object.__setattr__: OptimizedModule forwards setattr to the wrapped model, which we leave alone
    object.__setattr__(compiled, _REPORT_ATTR, report)
    return compiled


def report_of(compiled) -> Report:
    """The :class:`~burstc.report.Report` of a model returned by :func:`burstc.compile`, compiled yet or not."""
    rep = compiled.__dict__.get(_REPORT_ATTR) if hasattr(compiled, "__dict__") else None
    if rep is None:
        raise TypeError("burstc.report expects a model returned by burstc.compile")
    return rep


def report(compiled) -> Report:
    """The :class:`~burstc.report.Report` of a model returned by :func:`burstc.compile`."""
    rep = report_of(compiled)
    if not rep.compiled:
        raise RuntimeError(
            "burstc.report: nothing has been compiled yet; call the compiled model at least once "
            "(compilation happens on the first call)"
        )
    return rep
