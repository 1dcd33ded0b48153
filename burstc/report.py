"""What burstc found, rewrote, skipped and why; the graphs of every stage."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch.fx as fx

STAGES = ("captured", "rewritten", "forward", "backward")


@dataclass
class RewriteRecord:
    """One rewrite.  ``details`` holds kind-specific facts (chunk size, plan, predicted bytes);
    its keys are also readable as attributes (``record.plan``, ``record.predicted_bytes``)."""

    kind: str
    node: str
    module_path: str
    details: dict[str, Any] = field(default_factory=dict)
    graph_id: int = 0
    pass_name: str = ""

    def __getattr__(self, name):
        details = self.__dict__.get("details", {})
        if name in details:
            return details[name]
        raise AttributeError(f"{type(self).__name__} has no attribute {name!r} (details: {sorted(details)})")


@dataclass
class SkipRecord:
    """A candidate that was not rewritten, and why."""

    kind: str
    node: str
    module_path: str
    reason: str
    graph_id: int = 0
    pass_name: str = ""
    code: str = ""
    """A stable code from :data:`burstc.refusals.ALL_CODES` (tests and tools match it; ``reason`` is for people)."""


@dataclass
class PassRun:
    name: str
    graph_id: int
    rewrites: int
    skipped: int
    note: str = ""


@dataclass
class GraphRecord:
    """One Dynamo graph and what became of it (a model with graph breaks has several)."""

    graph_id: int
    graphs: dict[str, fx.GraphModule] = field(default_factory=dict)
    dropped_outputs: tuple[int, ...] = ()


class Report:
    """Returned by :func:`burstc.report`.

    - ``rewrites``: one :class:`RewriteRecord` per rewrite;
    - ``skipped``: candidates not rewritten, each with ``.reason``;
    - ``graphs``: stage name -> GraphModule (``captured``, ``rewritten``, ``forward``, ``backward``) of
      the first Dynamo graph that had a rewrite (else the first graph); ``graph_records`` has all;
    - ``passes``: one :class:`PassRun` per (pass, graph), with a note when the pass found nothing.
    """

    def __init__(self, config, world_size: int = 1):
        self.config = config
        self.world_size = world_size
        self.rewrites: list[RewriteRecord] = []
        self.skipped: list[SkipRecord] = []
        self.passes: list[PassRun] = []
        self.graph_records: list[GraphRecord] = []
        self.notes: list[str] = []

    # -- filled in by the backend -------------------------------------------------------------
    def new_graph(self) -> GraphRecord:
        record = GraphRecord(graph_id=len(self.graph_records))
        self.graph_records.append(record)
        return record

    def forget_graph(self, graph_id: int) -> None:
        """Drop what the passes recorded for ``graph_id`` (the backend reruns them on it)."""
        self.rewrites = [r for r in self.rewrites if r.graph_id != graph_id]
        self.skipped = [s for s in self.skipped if s.graph_id != graph_id]
        self.passes = [p for p in self.passes if p.graph_id != graph_id]

    def discard_graph(self, graph_id: int) -> None:
        """Drop the last graph record and everything recorded for it (a compile attempt Dynamo abandoned)."""
        if not self.graph_records or self.graph_records[-1].graph_id != graph_id:
            raise RuntimeError(f"burstc: only the last graph record can be discarded, not {graph_id}")
        self.forget_graph(graph_id)
        self.graph_records.pop()

    @property
    def compiled(self) -> bool:
        return bool(self.graph_records)

    @property
    def graphs(self) -> dict[str, fx.GraphModule]:
        if not self.graph_records:
            return {}
        rewritten_ids = {r.graph_id for r in self.rewrites}
        for record in self.graph_records:
            if record.graph_id in rewritten_ids:
                return record.graphs
        return self.graph_records[0].graphs

    def rewrites_of(self, kind: str) -> list[RewriteRecord]:
        return [r for r in self.rewrites if r.kind == kind]

    # -- presentation ---------------------------------------------------------------------------
    def __str__(self) -> str:
        lines = [
            f"burstc report: {len(self.graph_records)} graph(s), world size {self.world_size}, "
            f"backend {self.config.backend}",
        ]
        lines.append(_table(
            "rewrites",
            ["graph", "kind", "node", "module", "details"],
            [[r.graph_id, r.kind, r.node, r.module_path, _fmt_details(r.details)] for r in self.rewrites],
        ))
        lines.append(_table(
            "skipped",
            ["graph", "kind", "node", "module", "reason"],
            [[s.graph_id, s.kind, s.node, s.module_path, s.reason] for s in self.skipped],
        ))
        lines.append(_table(
            "passes",
            ["graph", "pass", "rewrites", "skipped", "note"],
            [[p.graph_id, p.name, p.rewrites, p.skipped, p.note] for p in self.passes],
        ))
        for record in self.graph_records:
            stages = ", ".join(f"{k} ({_count_ops(g)} ops)" for k, g in record.graphs.items())
            dropped = f"; outputs returned as None: {list(record.dropped_outputs)}" if record.dropped_outputs else ""
            lines.append(f"graph {record.graph_id}: {stages}{dropped}")
        lines.extend(f"note: {n}" for n in self.notes)
        return "\n".join(lines)

    __repr__ = __str__


def _count_ops(gm: fx.GraphModule) -> int:
    return sum(1 for n in gm.graph.nodes if n.op in ("call_function", "call_method", "call_module"))


def _fmt_bytes(n: int) -> str:
    for unit, size in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(n) >= size:
            return f"{n / size:.1f} {unit}"
    return f"{n} B"


def _fmt_value(v, key: str = "") -> str:
    if "bytes" in key and isinstance(v, dict):
        return "{" + ", ".join(f"{k}: {_fmt_bytes(x) if isinstance(x, int) else _fmt_value(x)}" for k, x in v.items()) + "}"
    if "bytes" in key and isinstance(v, int):
        return _fmt_bytes(v)
    if isinstance(v, float):
        return f"{v:.4g}"
    if isinstance(v, dict):
        return "{" + ", ".join(f"{k}: {_fmt_value(x)}" for k, x in v.items()) + "}"
    return str(v)


def _fmt_details(details: dict) -> str:
    return ", ".join(f"{k}={_fmt_value(v, k)}" for k, v in details.items() if v is not None)


def _table(title: str, header: list[str], rows: list[list]) -> str:
    if not rows:
        return f"{title}: none"
    cells = [header] + [[str(c) for c in row] for row in rows]
    widths = [max(len(row[i]) for row in cells) for i in range(len(header))]
    out = [f"{title}:"]
    for j, row in enumerate(cells):
        out.append("  " + "  ".join(c.ljust(w) for c, w in zip(row, widths)).rstrip())
        if j == 0:
            out.append("  " + "  ".join("-" * w for w in widths))
    return "\n".join(out)
