"""Host copies of a ring call's mask data, so that its decisions do not synchronize a GPU.

The ring op decides on the host which blocks a pair computes, which pairs the data hide, which rows travel and
how the batch splits into groups (:mod:`burstc.block_geometry`, :mod:`burstc.ops.batch_groups`); with documents
or key padding those decisions read the mask data (``doc_ids_BS``, ``key_valid_BS``).  Each read of a CUDA tensor
on the host (``tolist``, ``bool``, ``int``) waits for every kernel queued before it, so a call that read its data
where it decided (40 to 120 times per call at P = 2, more with P) drained the GPU's queue that often and could not
queue the next blocks or transfers ahead.  Instead the data are copied to the host once (:func:`host_copy`) and
every decision reads the copy; the kernels still take the device tensors.

A model passes the same mask tensors to every attention layer of a step and saves them for the backward, so the
copy is remembered per tensor object (until it is freed or written in place): one read-back per tensor per step.
A write that torch's version counter does not see (through ``.data``, or a buffer the data loader refills that
way) would leave a remembered copy stale, so the copies are forgotten when each sharded graph starts
(:func:`new_step`, called by :class:`burstc.backend.BurstBackend`): a copy lives for one forward and its backward.
On the CPU the copy is the tensor itself.

The other way, a host tensor copied to a GPU the usual way (``.to(device)``, ``torch.tensor(..., device=)``) waits
for the stream too (a pageable copy synchronizes): :func:`to_device` copies from pinned memory without waiting.
"""
from __future__ import annotations

import weakref

import torch
from torch import Tensor

_REMEMBERED = 8  # tensors whose host copy is kept: a step has one or two (document ids, key validity)
_copies: dict[int, tuple[weakref.ref, int, Tensor]] = {}
read_backs = 0
"""Device-to-host copies made so far (tests count them)."""


def host_device(device) -> bool:
    """Whether tensors on ``device`` can be read on the host without a synchronization (the CPU)."""
    return torch.device(device).type == "cpu"


def on_host(t: Tensor) -> bool:
    return host_device(t.device)


def host_copy(t: Tensor | None) -> Tensor | None:
    """``t`` readable on the host: itself on the CPU, else a copy (one read-back per tensor object and version)."""
    global read_backs
    if t is None or on_host(t):
        return t
    try:
        version = t._version
    except RuntimeError:  # an inference tensor has no version counter: copy it each call
        version = None
    key = id(t)
    remembered = _copies.get(key)
    if version is not None and remembered is not None and remembered[0]() is t and remembered[1] == version:
        return remembered[2]
    copy = t.to("cpu", copy=True)  # the one synchronization: waits for the work that produced t
    read_backs += 1
    if version is not None:
        if len(_copies) >= _REMEMBERED:
            _copies.pop(next(iter(_copies)))
        _copies[key] = (weakref.ref(t), version, copy)
    return copy


def new_step() -> None:
    """Forget every remembered copy: the next :func:`host_copy` of each tensor reads it back again (a sharded
    graph's forward starts; its backward then shares the copies its forward made)."""
    _copies.clear()


def _pinned(t: Tensor) -> Tensor:
    return t.pin_memory()


def to_device(t: Tensor, device) -> Tensor:
    """Host tensor ``t`` on ``device``, without waiting for the device's queued work (a pinned, non-blocking copy;
    torch keeps the pinned block until the copy is done); on the host, ``t`` itself."""
    if host_device(device):
        return t.to(device)
    return _pinned(t).to(device, non_blocking=True)
