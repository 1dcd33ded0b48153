"""Runtime guards around a compiled graph: what the passes assumed about the inputs, checked per call.

- :func:`all_ones_guarded`: a graph specialized on inputs being all ones (``assume_unpadded``'s
  ``facts.all_ones_inputs``) runs only when they are; any other call runs a graph compiled without
  the assumption (once, on the first such call; unsharded), with a warning and a report line.
- :func:`check_same_inputs_on_all_ranks`: ``check_inputs``: the ranks of a sharded graph must all
  have been given the same batch.
- :func:`reinsert_dropped_outputs`: outputs a pass dropped (``facts.dropped_outputs``) come back as
  ``None`` in their original positions.
"""
from __future__ import annotations

import warnings
from typing import Callable

import torch

from burstc._logging import log_event
from burstc.refusals import PIPELINE
from burstc.report import Report, SkipRecord


def all_ones_guarded(compiled: Callable, positions: tuple[int, ...], compile_fallback: Callable) -> Callable:
    """``compiled`` when the inputs at ``positions`` are all ones, else ``compile_fallback(args)`` (compiled
    on the first call that needs it, then reused).  One ``.all()`` per guarded input per call."""
    fallback: list[Callable] = []

    # Dynamo calls a backend's result with the graph inputs unpacked (*args)
    def run(*args):
        if all(bool(args[i].all()) for i in positions):
            return compiled(*args)
        if not fallback:
            fallback.append(compile_fallback(args))
        return fallback[0](*args)

    return run


def note_padded_fallback(report: Report, graph_id: int, input_names: str) -> None:
    """Report (and warn) that calls with a padded batch run an unspecialized, unsharded graph."""
    message = (f"input {input_names} was not all ones (a padded batch): the calls with such inputs run graph "
               f"{len(report.graph_records)}, compiled without the assumption (unsharded, replicated)")
    report.skipped.append(SkipRecord("unpadded_mask", input_names, "", message, graph_id, "backend",
                                     PIPELINE.padded_fallback))
    log_event("rewrites", "graph %d: %s", graph_id, message)
    warnings.warn(f"burstc: {message}", stacklevel=3)


def check_same_inputs_on_all_ranks(tensors, mesh) -> None:
    """``check_inputs``: all-reduces (max of the hash and of its negation) of a cheap position-weighted hash of
    the token inputs; ranks given different batches get a clear error instead of a silently wrong loss.
    The digest lives on the inputs' device (NCCL reduces only GPU tensors)."""
    import torch.distributed as dist

    device = tensors[0].device if tensors else torch.device("cpu")
    digest = torch.zeros(2, dtype=torch.float64, device=device)
    for t in tensors:
        flat = t.detach().reshape(-1).to(torch.float64)
        weights = torch.arange(1, flat.numel() + 1, dtype=torch.float64, device=flat.device) % 7919 + 1
        digest[0] += (flat * weights).sum()
        digest[1] += flat.numel()
    group = mesh.get_group()
    high, low = digest.clone(), -digest
    dist.all_reduce(high, op=dist.ReduceOp.MAX, group=group)
    dist.all_reduce(low, op=dist.ReduceOp.MAX, group=group)
    if not torch.equal(high, -low):
        raise RuntimeError(
            "burstc: the ranks were given different batches: every rank must get the full, identical batch "
            "(no DistributedSampler over the sequence-parallel ranks); burstc shards the sequence itself. "
            "check_inputs=False turns this check off")


def reinsert_dropped_outputs(outputs, dropped: tuple[int, ...]):
    values = list(outputs)
    for index in sorted(dropped):
        values.insert(index, None)
    return type(outputs)(values) if isinstance(outputs, tuple) else values
