"""burstc's own errors for mistakes around the mesh and for faults at run time, and the checks that raise them.

- :class:`MeshError`: the mesh cannot be used from this rank (the rank is not in it, its process group
  was never initialized or has been destroyed); the message names the mesh and the fix.
- :class:`PeerFailure`: a wait for another rank failed (its connection closed: the rank died); the message
  names the rank waited for.  :class:`PeerTimeout`, a ``PeerFailure`` and a ``TimeoutError``: the wait
  did not finish within ``burstc.compile(..., timeout=)`` (default: the process group's timeout).
"""
from __future__ import annotations

from datetime import timedelta

import torch.distributed as dist


class MeshError(RuntimeError):
    """The mesh given to :func:`burstc.compile` cannot be used from this rank."""


class PeerFailure(RuntimeError):
    """A wait for another rank's data (or its part of a collective) failed."""


class PeerTimeout(PeerFailure, TimeoutError):
    """A wait for another rank's data (or its part of a collective) did not finish in time."""


def describe_mesh(mesh) -> str:
    ranks = mesh.mesh.flatten().tolist()
    return f"the {len(ranks)}-rank DeviceMesh over ranks {ranks}"


def check_rank_in_mesh(mesh) -> None:
    """This rank must be one of the mesh's: the others have no coordinate in it and no sequence shard."""
    if mesh.get_coordinate() is not None:
        return
    rank, world = dist.get_rank(), dist.get_world_size()
    raise MeshError(
        f"burstc.compile: this rank ({rank} of a world of {world}) is not in {describe_mesh(mesh)}: call "
        f"burstc.compile (and the compiled model) only on the mesh's ranks, or build the mesh over all {world} "
        f"ranks (init_device_mesh('cpu' or 'cuda', ({world},))")


def check_mesh_alive(mesh) -> None:
    """The mesh's process group must still exist when the compiled model is called (a
    ``dist.destroy_process_group()`` in between leaves the compiled graphs naming a group that is gone)."""
    if not dist.is_initialized():
        raise MeshError(
            f"burstc: the process group of {describe_mesh(mesh)} is not initialized (destroyed after "
            "burstc.compile?): keep it alive while the compiled model is used, or after a new "
            "dist.init_process_group build a new mesh and call burstc.compile again")
    try:
        mesh.get_group()
    except Exception as error:  # noqa: BLE001 - any failure to resolve the group means the same to the user
        raise MeshError(
            f"burstc: the process group of {describe_mesh(mesh)} no longer exists ({type(error).__name__}: "
            f"{error}): it was destroyed after burstc.compile; build a new mesh on the new process group and "
            "call burstc.compile again") from error


def wait_for_peer(work, timeout_s: float | None, waiting: str, hint: str) -> None:
    """``work.wait()``, bounded by ``timeout_s`` (``None``: the process group's own timeout).  A wait that fails
    raises :class:`PeerTimeout` (or :class:`PeerFailure` when the peer's connection failed) with the message
    ``"<waiting> and failed (<bound>): <backend's error>. <hint>"``; ``waiting`` names the rank waited for."""
    error = None
    try:
        done = work.wait() if timeout_s is None else work.wait(timedelta(seconds=timeout_s))
    except Exception as exc:  # noqa: BLE001 - gloo/NCCL raise RuntimeError subclasses of their own
        done, error = False, exc
    if done is not False:
        return
    bound = f"burstc timeout={timeout_s:g} s" if timeout_s is not None else "the process group's timeout"
    timed_out = error is None or "time" in str(error).lower()  # gloo: "Timed out waiting ...", "Operation timed out"
    raise (PeerTimeout if timed_out else PeerFailure)(
        f"{waiting} and failed ({bound}){f': {error}' if error is not None else ''}. {hint}") from error
