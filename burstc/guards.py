"""Runtime guards around a compiled graph: what the passes assumed about the inputs, checked per call.

- :func:`all_ones_guarded`: a graph specialized on inputs being all ones (``assume_unpadded``'s
  ``facts.all_ones_inputs``) runs only when they are; any other call runs a graph compiled without
  the assumption (once, on the first such call; unsharded), with a warning and a report line.
- :func:`exactness_guarded`: a sharded graph exact only for calls whose data satisfy a condition (no query row
  that sees no key under a float fill; no hole in the padding under BLOOM's ALiBi) runs the unsharded graph
  for the calls that don't (compiled once), with a warning and a report line per condition.
- :func:`check_same_inputs_on_all_ranks`: ``check_inputs``: the ranks of a sharded graph must all
  have been given the same batch.
- :func:`reinsert_dropped_outputs`: outputs a pass dropped (``facts.dropped_outputs``: the logits the fused
  LM-head loss never materialized) come back as :data:`DROPPED_LOGITS` in their original positions, a
  stand-in whose every use raises an error that explains ``keep_logits``.
- :func:`watch_recompile_limit`: torch.compile's recompile limit hit while a burstc model is called (later
  calls of new shapes run eagerly: unsharded) is a warning and a report line.
"""
from __future__ import annotations

import contextlib
import logging
import warnings
from typing import Callable

import torch

from burstc._logging import log_event
from burstc.errors import describe_mesh, wait_for_peer
from burstc.refusals import PIPELINE, register_codes
from burstc.report import Report, SkipRecord

GUARD_CODES = register_codes("pipeline", {
    "recompile_limit": "torch.compile's recompile limit was hit: calls with new shapes run eagerly (unsharded)",
    "padding_hole_fallback": "a call's attention_mask has a hole under a mask exact only for contiguous padding "
                             "(BLOOM's ALiBi counts real tokens); it runs the unsharded graph",
    "fsdp_submodules": "fully_shard on submodules: each wrapped module compiles as its own graph (FSDP2's hooks "
                       "run outside the graph), and graphs without the token inputs run replicated",
})


def _guarded(compiled: Callable, holds: Callable, compile_fallback: Callable) -> Callable:
    """``compiled`` for the calls whose arguments satisfy ``holds(args)``, else ``compile_fallback(args)``
    (compiled on the first call that needs it, then reused)."""
    fallback: list[Callable] = []

    # Dynamo calls a backend's result with the graph inputs unpacked (*args)
    def run(*args):
        if holds(args):
            return compiled(*args)
        if not fallback:
            fallback.append(compile_fallback(args))
        return fallback[0](*args)

    return run


def all_ones_guarded(compiled: Callable, positions: tuple[int, ...], compile_fallback: Callable) -> Callable:
    """``compiled`` when the inputs at ``positions`` are all ones, else ``compile_fallback(args)`` (compiled
    on the first call that needs it, then reused).  One ``.all()`` per guarded input per call."""
    return _guarded(compiled, lambda args: all(bool(args[i].all()) for i in positions), compile_fallback)


def exactness_guarded(compiled: Callable, checks: tuple, compile_fallback: Callable, note_fallback: Callable
                      ) -> Callable:
    """``compiled`` unless this call's inputs break one of ``checks`` (``(code, mask, {runtime source: input
    position})``, from ``ShardingFact.call_checks``): :data:`PIPELINE.hidden_rows_fallback`, some query row sees
    no key; :data:`GUARD_CODES.padding_hole_fallback`, some row's valid keys are not one run.  Such a call runs
    ``compile_fallback(args)`` (compiled on the first one, then reused), ``note_fallback(code)`` the first time
    each code sends one there.  Every rank holds the same inputs (``check_inputs``), so every rank takes the
    same branch.  O(B * S) per check and call."""
    noted: set[str] = set()

    def failed(args) -> bool:
        code = next((code for code, mask, sources in checks if _BREAKS[code](mask, sources, args)), None)
        if code is not None and code not in noted:
            noted.add(code)
            note_fallback(code)
        return code is not None

    return _guarded(compiled, lambda args: not failed(args), compile_fallback)


def _hides_a_row(mask, sources: dict, args) -> bool:
    from burstc.attention_ir import Documents, KeyPadding, document_ids, has_fully_hidden_rows

    documents, padding = mask.term(Documents), mask.term(KeyPadding)
    key_valid = args[sources[padding.source]].ne(0)
    doc_ids = None
    if documents is not None:
        doc_ids = document_ids(args[sources[documents.source]], key_valid.shape[0], documents.ids)
    return has_fully_hidden_rows(mask, doc_ids_BS=doc_ids, key_valid_BS=key_valid)


def _has_a_padding_hole(mask, sources: dict, args) -> bool:
    from burstc.attention_ir import KeyPadding, padding_is_contiguous

    return not padding_is_contiguous(args[sources[mask.term(KeyPadding).source]].ne(0))


_BREAKS = {PIPELINE.hidden_rows_fallback: _hides_a_row, GUARD_CODES.padding_hole_fallback: _has_a_padding_hole}

_FALLBACK_WHY = {
    PIPELINE.hidden_rows_fallback:
        "a query row whose every key is hidden (left padding?) under an attention mask the model fills with a float "
        "(eager averages such a row over all keys, or gives NaN; the ring op gives 0)",
    GUARD_CODES.padding_hole_fallback:
        "an attention_mask row whose real tokens are not one contiguous run (a hole in the padding) under a bias the "
        "model computes from the count of real tokens (BLOOM's ALiBi: the ring op's ALiBi equals it only when each "
        "row's real tokens are contiguous)",
}


def note_exactness_fallback(report: Report, graph_id: int, fallback_id: int, code: str) -> None:
    """Report (and warn) that calls of graph ``graph_id`` that break check ``code`` run the unsharded graph
    ``fallback_id``; the reason is recorded on that graph, so that its summary line says why it is replicated."""
    message = (f"the calls of graph {graph_id} with {_FALLBACK_WHY[code]} run graph {fallback_id}, compiled "
               "unsharded (replicated), exact")
    report.skipped.append(SkipRecord("shard", "graph", "", message, fallback_id, "backend", code))
    log_event("rewrites", "graph %d: %s", graph_id, message)
    warnings.warn(f"burstc: {message}", stacklevel=3)


def note_padded_fallback(report: Report, graph_id: int, input_names: str) -> None:
    """Report (and warn) that calls with a padded batch run an unspecialized, unsharded graph."""
    message = (f"input {input_names} was not all ones (a padded batch): the calls with such inputs run graph "
               f"{len(report.graph_records)}, compiled without the assumption (unsharded, replicated)")
    report.skipped.append(SkipRecord("unpadded_mask", input_names, "", message, graph_id, "backend",
                                     PIPELINE.padded_fallback))
    log_event("rewrites", "graph %d: %s", graph_id, message)
    warnings.warn(f"burstc: {message}", stacklevel=3)


def warn_replicated_graph(report: Report, refusal: SkipRecord, world_size: int, attention_calls: int) -> None:
    """A mesh graph that holds attention but runs replicated puts the whole sequence's attention on every rank:
    the memory sequence parallelism was for.  Warn when it is compiled, with the refusal the report's first line
    gives for it, besides the report."""
    warnings.warn(f"burstc: graph {refusal.graph_id} runs replicated on {world_size} ranks (its {attention_calls} "
                  f"attention call(s) over the whole sequence on every rank, exact): {refusal.reason} "
                  f"[{refusal.code}]{report.model_cause()}", stacklevel=3)


def fsdp_wrapped_submodules(model) -> list[str]:
    """Paths of ``model``'s submodules (not the root) that ``fully_shard`` wrapped."""
    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:  # a torch built without distributed
        return []
    if not isinstance(model, torch.nn.Module):
        return []
    return [name for name, module in model.named_modules() if name and isinstance(module, FSDPModule)]


def note_fsdp_submodules(report: Report, model) -> None:
    """Report (and warn) that FSDP2 on submodules splits the model into graphs that run replicated.

    torch 2.13 runs FSDP2's pre- and post-forward hooks under ``torch._dynamo.disable``: a graph breaks at every
    wrapped module, each wrapped module compiles alone, and its graph takes the hidden states as a float input.
    burstc shards a graph from its token inputs, so those graphs run unsharded (exact, every rank the whole
    sequence).  ``fully_shard`` on the root only, or DDP over the data-parallel dim, keeps one graph (measured:
    both exact against single-device eager on a 2 x 2 ("dp", "cp") mesh)."""
    wrapped = fsdp_wrapped_submodules(model)
    if not wrapped:
        return
    shown = ", ".join(wrapped[:3]) + (f", ... ({len(wrapped)} modules)" if len(wrapped) > 3 else "")
    message = (f"fully_shard was applied to submodules ({shown}): torch runs FSDP2's hooks outside the graph, so "
               "each wrapped module compiles as its own graph without the token inputs, and those graphs run "
               "replicated (exact, but no sequence parallelism). Apply fully_shard to the root module only (all "
               "parameters are then gathered at once per step) or use DDP over the data-parallel mesh dim")
    report.notes.append(message)
    report.skipped.append(SkipRecord("fsdp", "model", "", message, 0, "compile", GUARD_CODES.fsdp_submodules))
    log_event("rewrites", "%s", message)
    warnings.warn(f"burstc: {message}", stacklevel=3)


def check_same_inputs_on_all_ranks(tensors, mesh, timeout_s: float | None = None) -> None:
    """``check_inputs``: all-reduces (max of the hash and of its negation) of a cheap position-weighted hash of
    the token inputs; ranks given different batches get a clear error instead of a silently wrong loss.
    The digest lives on the inputs' device (NCCL reduces only GPU tensors).  The wait for the other ranks
    is bounded by ``timeout_s`` (``None``: the process group's timeout)."""
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
    rank = dist.get_rank()
    others = [r for r in mesh.mesh.flatten().tolist() if r != rank]
    who = f"rank {others[0]}" if len(others) == 1 else f"one of ranks {others}"
    for tensor in (high, low):
        wait_for_peer(dist.all_reduce(tensor, op=dist.ReduceOp.MAX, group=group, async_op=True), timeout_s,
                      f"burstc check_inputs: rank {rank} waited for {who} of {describe_mesh(mesh)} to join the "
                      "input check", "Every rank of the mesh must call the compiled model, with the same batch")
    if not torch.equal(high, -low):
        raise RuntimeError(
            "burstc: the ranks were given different batches: every rank must get the full, identical batch "
            "(no DistributedSampler over the sequence-parallel ranks); burstc shards the sequence itself. "
            "check_inputs=False turns this check off")


class LogitsDroppedError(AttributeError):
    """A use of the logits that the fused LM-head loss never materialized (an AttributeError, so that
    ``hasattr`` and ``getattr(x, name, default)`` on them still answer)."""


class DroppedLogits:
    """What the compiled model returns in place of logits it never materialized (``keep_logits``)."""

    MESSAGE = ("burstc: these logits were never computed: burstc fused the LM head into the loss, so a model "
               "compiled with gradients enabled (training) returns this stand-in instead of the [B, S, vocab] "
               "logits. Pass keep_logits=True to burstc.compile to keep them (they then cost their memory), or "
               "call the model under torch.no_grad() / torch.inference_mode() (evaluation keeps them)")

    def __getattr__(self, name):
        raise LogitsDroppedError(f"{self.MESSAGE} (read attribute {name!r})")

    def __getitem__(self, key):
        raise LogitsDroppedError(f"{self.MESSAGE} (indexed)")

    def __iter__(self):
        raise LogitsDroppedError(f"{self.MESSAGE} (iterated)")

    def __len__(self):
        raise LogitsDroppedError(f"{self.MESSAGE} (len())")

    def __bool__(self):
        raise LogitsDroppedError(f"{self.MESSAGE} (truth value)")

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        raise LogitsDroppedError(f"{cls.MESSAGE} (passed to {getattr(func, '__name__', func)})")

    def _arithmetic(self, *_):
        raise LogitsDroppedError(f"{self.MESSAGE} (arithmetic)")

    __add__ = __radd__ = __sub__ = __rsub__ = __mul__ = __rmul__ = __truediv__ = __rtruediv__ = _arithmetic
    __matmul__ = __rmatmul__ = __neg__ = __pow__ = _arithmetic

    def __repr__(self):
        return "<logits dropped by burstc's fused LM-head loss; burstc.compile(..., keep_logits=True) keeps them>"


DROPPED_LOGITS = DroppedLogits()


def reinsert_dropped_outputs(outputs, dropped: tuple[int, ...]):
    values = list(outputs)
    for index in sorted(dropped):
        values.insert(index, DROPPED_LOGITS)
    return type(outputs)(values) if isinstance(outputs, tuple) else values


# the reports of the burstc models being called, innermost last (Dynamo compiles on the calling thread)
_CALLING: list[Report] = []
_DYNAMO_FRAME_LOG = "torch._dynamo.convert_frame"


class _RecompileLimitHandler(logging.Handler):
    """Sees Dynamo's "hit config.recompile_limit" warning and reports it to the burstc model being called."""

    def emit(self, record: logging.LogRecord) -> None:
        if not _CALLING or "hit config." not in str(record.msg) or len(record.args or ()) < 3:
            return
        limit_type, limit, function = record.args[:3]
        note_recompile_limit(_CALLING[-1], str(limit_type), limit, str(function))


_HANDLER = _RecompileLimitHandler(level=logging.WARNING)


@contextlib.contextmanager
def watch_recompile_limit(report: Report):
    logger = logging.getLogger(_DYNAMO_FRAME_LOG)
    if _HANDLER not in logger.handlers:
        logger.addHandler(_HANDLER)
    _CALLING.append(report)
    try:
        yield
    finally:
        _CALLING.pop()


def note_recompile_limit(report: Report, limit_type: str, limit, function: str) -> None:
    """Once per function and limit: a report line and a warning."""
    if any(s.code == GUARD_CODES.recompile_limit and s.node == function for s in report.skipped):
        return
    message = (f"torch.compile hit torch._dynamo.config.{limit_type} ({limit}) for {function}: calls with a new "
               "shape now run eagerly, unsharded and unfused (correct, but the whole sequence on every rank). "
               "Use fewer distinct lengths (pad to a few buckets) or raise "
               f"torch._dynamo.config.{limit_type}")
    graph_id = max(len(report.graph_records) - 1, 0)
    report.skipped.append(SkipRecord("recompile_limit", function, "", message, graph_id, "backend",
                                     GUARD_CODES.recompile_limit))
    log_event("rewrites", "%s", message)
    warnings.warn(f"burstc: {message}", stacklevel=2)
