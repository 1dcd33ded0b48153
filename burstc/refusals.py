"""Stable codes for every candidate a pass declines to rewrite.

A :class:`~burstc.report.SkipRecord` carries a ``code`` (stable, for tests and tools) next to its
free-text ``reason`` (for people).  Each pass declares its codes where it raises them::

    CODES = register_codes("shard", {
        "mixes_positions": "an op mixes sequence positions in a way the shard pass does not understand",
        ...
    })
    raise Refused(CODES.mixes_positions, "softmax over the sequence dim")

and :data:`ALL_CODES` lists every code with its one-line meaning (``passes/README.md`` prints the table).
"""
from __future__ import annotations

import dataclasses
from types import SimpleNamespace

ALL_CODES: dict[str, str] = {}


def register_codes(prefix: str, meanings: dict[str, str]) -> SimpleNamespace:
    """Register ``prefix.name`` for each entry; returns a namespace ``codes.name == "prefix.name"``."""
    names = {}
    for name, meaning in meanings.items():
        code = f"{prefix}.{name}"
        if ALL_CODES.get(code, meaning) != meaning:
            raise ValueError(f"refusal code {code!r} registered twice with different meanings")
        ALL_CODES[code] = meaning
        names[name] = code
    return SimpleNamespace(**names)


@dataclasses.dataclass(frozen=True)
class Refusal:
    """Why a candidate was not rewritten: a registered ``code`` and a ``reason`` naming the specifics."""

    code: str
    reason: str

    def __post_init__(self):
        if self.code not in ALL_CODES:
            raise ValueError(f"unregistered refusal code {self.code!r}")

    def __str__(self) -> str:
        return self.reason


class Refused(Exception):
    """Raised inside a pass's matcher; the pass turns it into a skip record.  ``node`` is the node the
    refusal is about (or None)."""

    def __init__(self, code: str, reason: str, node=None):
        super().__init__(reason)
        self.refusal = Refusal(code, reason)
        self.node = node

    @property
    def code(self) -> str:
        return self.refusal.code

    @property
    def reason(self) -> str:
        return self.refusal.reason


# Codes that belong to no single pass: the pipeline's own.
PIPELINE = register_codes("pipeline", {
    "pass_failed": "a pass raised an unexpected error on this candidate; it was left unrewritten",
    "checkpoint_kept_inlined": "a checkpointed region could not be restored after the passes and stays inlined",
    "padded_fallback": "a call's inputs broke a specialization; it runs a graph compiled without it",
    "hidden_rows_fallback": "a call has a query row that sees no key under a mask the model fills with a float "
                            "(eager averages such rows over all keys); it runs the unsharded graph",
})
