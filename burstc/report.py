"""What burstc found, rewrote, skipped and why; the graph after every pass and stage."""
from __future__ import annotations

import textwrap
from dataclasses import dataclass, field
from typing import Any

import torch.fx as fx
from torch.fx._lazy_graph_module import _LazyGraphModule

# the graphs every record has; between "captured" and "rewritten" it holds one graph per Dynamo-stage pass
# that ran (keyed by pass name), and after "forward"/"backward" one per AOT-stage pass
STAGES = ("captured", "rewritten", "forward", "backward")
_CELL_WIDTH = 72  # detail-table cells wider than this fold onto more lines


def snapshot_graph(gm: fx.GraphModule) -> fx.GraphModule:
    """A copy of ``gm``'s graph (node meta shared, not deep-copied) that later passes can't mutate.

    Lazy: its Python code is generated when first read or called (``.code``, ``str``, a call), not here. A
    compile takes a dozen snapshots (every stage and pass, for the report) and reads few of them: generating
    each one's code was ~0.19 s of a 4.7 s two-layer HF Llama compile."""
    graph = fx.Graph()
    out = graph.graph_copy(gm.graph, {})
    graph.output(out)
    copy = _LazyGraphModule(gm, graph)
    copy.meta = dict(getattr(gm, "meta", {}))
    return copy


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
    sharding: Any = None
    """A :class:`burstc.pass_context.ShardingFact` when the graph runs sequence-parallel, else ``None``."""
    schedules: dict[str, dict[str, int]] = field(default_factory=dict)
    """Per stage (``"forward"``, ``"backward"``), the order Inductor ran the graph's nodes in (node name ->
    position; :func:`burstc.memory.inductor_schedule`), when Inductor scheduled it."""


class Report:
    """Returned by :func:`burstc.report`.

    - ``rewrites``: one :class:`RewriteRecord` per rewrite;
    - ``skipped``: candidates not rewritten, each with ``.reason``;
    - ``graphs[graph_id][name]``: the GraphModule of graph ``graph_id`` after ``name``: ``captured``, each
      pass that ran (by pass name), ``rewritten``, ``forward``, ``backward``.  ``graphs[name]`` (a string
      key) is the same for the first Dynamo graph that had a rewrite (else the first graph);
    - ``passes``: one :class:`PassRun` per (pass, graph), with a note when the pass found nothing;
    - ``traces``: this rank's traced windows (:class:`burstc.timeline.TraceWindow`: file, ring transfer time,
      the part hidden behind compute, ``overlap``), when tracing is on.
    """

    def __init__(self, config, world_size: int = 1):
        self.config = config
        self.world_size = world_size
        self.rewrites: list[RewriteRecord] = []
        self.skipped: list[SkipRecord] = []
        self.passes: list[PassRun] = []
        self.graph_records: list[GraphRecord] = []
        self.notes: list[str] = []
        self.traces: list = []
        self.memory_plans: list = []
        """One :class:`burstc.memory.MemoryPlan` per graph compiled under ``memory_budget=``."""
        self.kept_rows: list = []
        """``(graph id, burstc.kept_rows.KeptRows)`` per attention whose output a ``checkpoint_keep < 1`` keeps in
        part."""

    # -- filled in by the backend -------------------------------------------------------------
    def new_graph(self) -> GraphRecord:
        record = GraphRecord(graph_id=len(self.graph_records))
        self.graph_records.append(record)
        return record

    def add_memory_plan(self, plan) -> None:
        """Record what ``memory_budget=`` chose; warn when no checkpoint mode fits the budget."""
        self.memory_plans = [p for p in self.memory_plans if p.graph_id != plan.graph_id] + [plan]
        if not plan.fits:
            import warnings

            warnings.warn(f"burstc: {plan.summary()}", stacklevel=2)

    def set_kept_rows(self, graph_id: int, kept: list) -> None:
        self.kept_rows = [(g, k) for g, k in self.kept_rows if g != graph_id] + [(graph_id, k) for k in kept]

    def kept_rows_summary(self) -> list[str]:
        lines = []
        for graph_id in sorted({g for g, _ in self.kept_rows}):
            kept = [k for g, k in self.kept_rows if g == graph_id]
            received = [k.recompute_bytes_received for k in kept]
            moved = "" if None in received else f", the recompute receives {sum(received) / 2**20:.2f} MiB"
            lines.append(f"graph {graph_id}: checkpoint_keep: {len(kept)} attention(s) keep the last "
                         f"{kept[0].kept_rows} of {kept[0].local_rows} local rows' O and LSE "
                         f"({sum(k.kept_bytes for k in kept) / 2**20:.2f} MiB per rank); the backward recomputes "
                         f"the ring for the first {kept[0].recomputed_rows}{moved} (busiest rank, all attentions)")
        return lines

    def forget_graph(self, graph_id: int) -> None:
        """Drop what the passes recorded for ``graph_id`` (the backend reruns them on it)."""
        self.memory_plans = [p for p in self.memory_plans if p.graph_id != graph_id]
        self.kept_rows = [(g, k) for g, k in self.kept_rows if g != graph_id]
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
    def graphs(self) -> "GraphsView":
        return GraphsView(self)

    def main_record(self) -> GraphRecord | None:
        """The first graph that had a rewrite, else the first graph."""
        rewritten_ids = {r.graph_id for r in self.rewrites}
        return next((g for g in self.graph_records if g.graph_id in rewritten_ids),
                    self.graph_records[0] if self.graph_records else None)

    def pass_run(self, name: str, graph_id: int | None = None) -> "PassRun":
        """The run of pass ``name`` on ``graph_id`` (default: the first graph it ran on)."""
        for run in self.passes:
            if run.name == name and (graph_id is None or run.graph_id == graph_id):
                return run
        raise KeyError(f"pass {name!r} did not run on graph {graph_id}; runs: "
                       f"{[(p.graph_id, p.name) for p in self.passes]}")

    def summary(self, graph_id: int) -> str:
        """One line: how graph ``graph_id`` runs, and the top reason when it is not sharded."""
        record = self.graph_records[graph_id]
        if record.sharding is not None:
            fact = record.sharding
            plans = _counted(fact.plans)
            ring = f", {fact.ring} ring" if fact.ring != "flat" else ""
            return (f"graph {graph_id}: sharded over {fact.world_size} ranks ({fact.layout} layout{ring}"
                    + (f"; attention plans: {plans}" if plans else "") + ")")
        fused = sum(1 for r in self.rewrites if r.graph_id == graph_id and r.kind == "lm_head_loss")
        fused_note = f" (fused LM-head loss x{fused})" if fused else ""
        if self.world_size <= 1:
            return f"graph {graph_id}: one device{fused_note}"
        refusals = [s for s in self.skipped if s.graph_id == graph_id and s.kind == "shard"]
        reason = refusals[0].reason if refusals else "nothing to shard in this graph"
        return f"graph {graph_id}: replicated on {self.world_size} ranks{fused_note}: {reason}{self.model_cause()}"

    def model_cause(self) -> str:
        """What the model's wrapping does to every graph (FSDP2 on submodules), as a clause for a replicated graph's
        line: the graph's own refusal names the symptom (no token inputs), this the cause; else ''."""
        wrapped = [s for s in self.skipped if s.kind == "fsdp"]
        if not wrapped:
            return ""
        return (f" (because fully_shard wraps submodules: each wrapped module compiles alone, without the token "
                f"inputs [{wrapped[0].code}])")

    @property
    def memory(self):
        """Predicted per-rank memory of one training step (:class:`burstc.memory.MemoryEstimate`: ``.peak``,
        ``.breakdown()``), from the forward and backward graphs; a ``RuntimeError`` before a backward ran."""
        from burstc.memory import predict_step

        return predict_step(self)

    def memory_line(self) -> str | None:
        """The report's memory line, ``None`` before any backward graph exists."""
        if not any("backward" in g.graphs for g in self.graph_records):
            return None
        try:
            return self.memory.summary()
        except Exception as err:  # the report must print whatever the model cannot handle
            return f"memory: not predicted ({type(err).__name__}: {err})"

    def budget_check_line(self) -> str | None:
        """When a ``memory_budget`` plan fit by its FX-order prediction but the step replayed in Inductor's kernel
        order (its buffers, after fusion) peaks above the budget: the line that says so, else ``None``."""
        fitting = [p for p in self.memory_plans if p.fits]
        if not fitting or not any("backward" in g.graphs for g in self.graph_records):
            return None
        try:
            estimate = self.memory
        except Exception:  # the memory line reports it
            return None
        budget = min(p.budget for p in fitting)
        if not estimate.scheduled or estimate.peak <= budget:
            return None
        return (f"warning: memory_budget {_fmt_bytes(budget)} per rank: the plan fit by the FX order's prediction, "
                f"but replayed in Inductor's kernels the step peaks at {_fmt_bytes(estimate.peak)} "
                f"({estimate.peak / budget:.2f}x the budget; Inductor's fusion keeps more alive): lower memory_budget "
                f"by that factor")

    def rewrites_of(self, kind: str) -> list[RewriteRecord]:
        return [r for r in self.rewrites if r.kind == kind]

    # -- presentation ---------------------------------------------------------------------------
    def __str__(self) -> str:
        lines = [self.summary(g.graph_id) for g in self.graph_records]
        lines.append(f"burstc report: {len(self.graph_records)} graph(s), world size {self.world_size}, "
                     f"backend {self.config.backend}")
        lines.append(_table(
            "rewrites",
            ["graph", "kind", "node", "module", "details"],
            [[r.graph_id, r.kind, r.node, r.module_path, _fmt_details(r.details)] for r in self.rewrites],
        ))
        lines.append(_table(
            "skipped",
            ["graph", "kind", "node", "module", "code", "reason"],
            [[s.graph_id, s.kind, s.node, s.module_path, s.code, s.reason] for s in self.skipped],
        ))
        lines.append(_table(
            "passes",
            ["graph", "pass", "rewrites", "skipped", "note"],
            [[p.graph_id, p.name, p.rewrites, p.skipped, p.note] for p in self.passes],
        ))
        for record in self.graph_records:
            stages = ", ".join(f"{k} ({_count_ops(g)} ops)" for k, g in record.graphs.items() if k in STAGES)
            dropped = f"; outputs returned as None: {list(record.dropped_outputs)}" if record.dropped_outputs else ""
            lines.append(f"graph {record.graph_id}: {stages}{dropped}")
        lines.extend(plan.summary() for plan in self.memory_plans)
        lines.extend(self.kept_rows_summary())
        memory = self.memory_line()
        if memory is not None:
            lines.append(memory)
        over = self.budget_check_line()
        if over is not None:
            lines.append(over)
        lines.extend(f"note: {n}" for n in self.notes)
        lines.extend(str(t) for t in self.traces)
        return "\n".join(lines)

    __repr__ = __str__


class GraphsView:
    """``report.graphs[graph_id][name]`` (every graph, every pass) or ``report.graphs[name]`` (the main graph)."""

    def __init__(self, report: Report):
        self._report = report

    def _main(self) -> dict[str, fx.GraphModule]:
        record = self._report.main_record()
        return record.graphs if record is not None else {}

    def __getitem__(self, key):
        if isinstance(key, int):
            return self._report.graph_records[key].graphs
        return self._main()[key]

    def get(self, key, default=None):
        try:
            return self[key]
        except (KeyError, IndexError):
            return default

    def __contains__(self, key) -> bool:
        return self.get(key) is not None

    def keys(self):
        return self._main().keys()

    def items(self):
        return self._main().items()

    def __iter__(self):
        return iter(self._main())

    def __len__(self) -> int:
        return len(self._main())

    def __repr__(self) -> str:
        return f"GraphsView(graphs={[list(g.graphs) for g in self._report.graph_records]})"


def _counted(items) -> str:
    counts: dict[str, int] = {}
    for item in items:
        counts[item] = counts.get(item, 0) + 1
    return ", ".join(f"{k} x{n}" for k, n in counts.items())


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
    # a long cell folds onto several lines of its column, so a row stays readable in a terminal
    cells = [[[str(c)] for c in header]] + [
        [textwrap.wrap(str(c), _CELL_WIDTH, break_on_hyphens=False) or [""] for c in row] for row in rows]
    widths = [max(len(line) for row in cells for line in row[i]) for i in range(len(header))]
    out = [f"{title}:"]
    for j, row in enumerate(cells):
        for k in range(max(len(c) for c in row)):
            out.append("  " + "  ".join((c[k] if k < len(c) else "").ljust(w) for c, w in zip(row, widths)).rstrip())
        if j == 0:
            out.append("  " + "  ".join("-" * w for w in widths))
    return "\n".join(out)
