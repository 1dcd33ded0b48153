"""``BURSTC_LOGS``: in the spirit of ``TORCH_LOGS``.

``BURSTC_LOGS=rewrites`` logs every rewrite and skip; ``graphs`` also prints the graph of every stage;
``passes`` logs each pass run; ``all`` is everything.  Comma separated.  Logs go to the ``burstc``
logger (stderr by default).  ``BURSTC_LOGS_DIR=path`` also writes each stage's graph to a file there.
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


def _ensure_handler():
    if not log.handlers:
        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter("[burstc] %(message)s"))
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
        path = Path(out_dir)
        path.mkdir(parents=True, exist_ok=True)
        (path / f"graph{graph_id}_{stage}.py").write_text(text)
