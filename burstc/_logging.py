"""``BURSTC_LOGS``: in the spirit of ``TORCH_LOGS``.

``BURSTC_LOGS=rewrites`` logs every rewrite and skip; ``graphs`` also prints the graph of every stage;
``passes`` logs each pass run; ``all`` is everything.  Comma separated.  Logs go to the ``burstc``
logger (stderr by default), each line once, prefixed ``[burstc]`` or, on a rank of a multi-rank process group,
``[burstc rank R]``.  ``BURSTC_LOGS_DIR=path`` also writes each stage's graph to a file there (under
``path/rankR/`` on a rank of a multi-rank process group, so that ranks do not overwrite each other's files).
"""
from __future__ import annotations

import logging
import os
from pathlib import Path

log = logging.getLogger("burstc")
CHANNELS = ("rewrites", "graphs", "passes")


def enabled_channels() -> set[str]:
    raw = os.environ.get("BURSTC_LOGS", "")
    names = {c.strip().lstrip("+") for c in raw.split(",") if c.strip()}
    if "all" in names:
        return set(CHANNELS)
    unknown = names - set(CHANNELS)
    if unknown:
        log.warning("BURSTC_LOGS: unknown channel(s) %s; known: %s, all", sorted(unknown), CHANNELS)
    return names & set(CHANNELS)


def _rank() -> int | None:
    """This process's rank when it is one of several in the default process group, else None."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        return dist.get_rank()
    return None


class _RankFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        rank = _rank()
        prefix = "[burstc]" if rank is None else f"[burstc rank {rank}]"
        return f"{prefix} {super().format(record)}"


def _ensure_handler():
    # one handler of ours, and no propagation to the root logger's (which would print every line again)
    if not any(isinstance(h.formatter, _RankFormatter) for h in log.handlers):
        handler = logging.StreamHandler()
        handler.setFormatter(_RankFormatter("%(message)s"))
        log.addHandler(handler)
    log.propagate = False
    log.setLevel(logging.INFO)


def log_event(channel: str, message: str, *args):
    if channel in enabled_channels():
        _ensure_handler()
        log.info(message, *args)


def dump_graph(stage: str, graph_id: int, gm):
    channels = enabled_channels()
    out_dir = os.environ.get("BURSTC_LOGS_DIR")
    if "graphs" not in channels and not out_dir:
        return
    text = gm.print_readable(print_output=False, include_stride=True, include_device=True)
    if "graphs" in channels:
        _ensure_handler()
        log.info("graph %d, stage %s:\n%s", graph_id, stage, text)
    if out_dir:
        rank = _rank()
        path = Path(out_dir) if rank is None else Path(out_dir) / f"rank{rank}"
        path.mkdir(parents=True, exist_ok=True)
        (path / f"graph{graph_id}_{stage}.py").write_text(text)
